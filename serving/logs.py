"""sharp-serve's logging: one line per event on stderr, as text for a terminal or as JSON objects for a cluster's
log collector (`--log-format json`: time, level, logger, message, and the traceback when there is one)."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")


class JsonLines(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["traceback"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


class _Stderr(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a record arrives (embedding programs and tests replace it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def configure(level: str = "info", fmt: str = "text") -> Callable[[], None]:
    """Send sharp's loggers to stderr in `fmt` from `level` (other libraries' loggers are left alone); returns
    what undoes it, so a command run in-process leaves logging as it found it."""
    handler = _Stderr()
    if fmt == "json":
        handler.setFormatter(JsonLines())
    else:
        line = "%(asctime)s.%(msecs)03dZ %(levelname)s %(name)s: %(message)s"
        formatter = logging.Formatter(line, "%Y-%m-%dT%H:%M:%S")
        formatter.converter = time.gmtime
        handler.setFormatter(formatter)
    logger = logging.getLogger("sharp")
    before = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False

    def restore() -> None:
        logger.removeHandler(handler)
        logger.setLevel(before[0])
        logger.propagate = before[1]

    return restore
