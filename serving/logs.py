"""sharp-serve's logging: one line per event on stderr, as text for a terminal or as JSON objects for a cluster's
log collector (`--log-format json`: time, level, logger, message, and the traceback when there is one)."""

from __future__ import annotations

import json
import logging
import time

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


def configure(level: str = "info", fmt: str = "text") -> None:
    """Replace the root logger's handlers with one stderr handler in `fmt` at `level`."""
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonLines())
    else:
        line = "%(asctime)s.%(msecs)03dZ %(levelname)s %(name)s: %(message)s"
        formatter = logging.Formatter(line, "%Y-%m-%dT%H:%M:%S")
        formatter.converter = time.gmtime
        handler.setFormatter(formatter)
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
