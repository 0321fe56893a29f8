"""The text corpus every machine with Python has: modules of the standard library's own sources.

The zoo models train on it (first 90%) and are evaluated on the rest; the export check of a quantized or
half-precision file reads that held-out tail as its text.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

# A fixed list (not a directory walk) so the corpus is the same on every CPython 3.10+
STDLIB_MODULES = [
    "abc.py",
    "argparse.py",
    "ast.py",
    "base64.py",
    "bisect.py",
    "calendar.py",
    "codecs.py",
    "collections/__init__.py",
    "contextlib.py",
    "copy.py",
    "csv.py",
    "dataclasses.py",
    "datetime.py",
    "decimal.py",
    "difflib.py",
    "enum.py",
    "fnmatch.py",
    "fractions.py",
    "functools.py",
    "glob.py",
    "gzip.py",
    "heapq.py",
    "hmac.py",
    "inspect.py",
    "ipaddress.py",
    "json/decoder.py",
    "json/encoder.py",
    "locale.py",
    "logging/__init__.py",
    "operator.py",
    "os.py",
    "pathlib.py",
    "pprint.py",
    "queue.py",
    "random.py",
    "re/__init__.py",
    "shlex.py",
    "shutil.py",
    "socket.py",
    "statistics.py",
    "string.py",
    "subprocess.py",
    "tempfile.py",
    "textwrap.py",
    "threading.py",
    "tokenize.py",
    "traceback.py",
    "typing.py",
    "uuid.py",
    "warnings.py",
    "weakref.py",
    "zipfile.py",
]
VALIDATION = 0.9  # the fraction of the corpus before the held-out tail (TextData's split)


def stdlib_corpus() -> bytes:
    """The listed standard-library modules that exist here (skipping any that do not), newline-joined."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return b"\n".join((root / m).read_bytes() for m in STDLIB_MODULES if (root / m).is_file())


def validation_text() -> str:
    """The corpus' held-out tail as text."""
    data = stdlib_corpus()
    return data[int(len(data) * VALIDATION) :].decode("utf-8", errors="replace")
