"""The bearer-token check both APIs make: `authorization: Bearer <token>`, the scheme case-insensitive and the
token compared in constant time."""

from __future__ import annotations

import hmac


def bearer_matches(header: str | None, token: bytes) -> bool:
    scheme, _, given = str(header or "").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token)
