"""`Status`: why a request ended without its output, in no transport's words.

The engine and request validation speak it; each API maps it at its edge with one table — the gRPC service to a
`grpc.StatusCode` (api/grpc_service.py `GRPC_CODES`), the HTTP API to an HTTP status (api/errors.py `HTTP_STATUS`).
The names are gRPC's canonical ones, so the metrics' `status` label reads the same whichever door a request used.
"""

from __future__ import annotations

import enum


class Status(enum.Enum):
    INVALID_ARGUMENT = "invalid_argument"  # the request itself is wrong
    OUT_OF_RANGE = "out_of_range"  # well-formed, but past a limit of this model or server
    RESOURCE_EXHAUSTED = "resource_exhausted"  # a full queue (transient) or more than the KV budget
    UNAVAILABLE = "unavailable"  # draining or stopping: retry elsewhere
    INTERNAL = "internal"  # the model or the server failed
