"""What the commands say when they refuse: one line, whatever a library's message held, and for a path that is not
there, the near names beside it (a typo is the usual cause)."""

from __future__ import annotations

import argparse
import difflib
from pathlib import Path


class UsageError(Exception):
    """A user mistake: one line on stderr, exit 2 (every sharp command's)."""


class Parser(argparse.ArgumentParser):
    """argparse that refuses a command line with one line, `prog: message`, and exit 2 (not usage + message)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message}\n")


def did_you_mean(path: Path) -> str:
    """'; did you mean A or B?' naming the entries of `path`'s directory that are close to its name, or ''."""
    parent = path.parent
    if not parent.is_dir():
        return ""
    try:
        names = [p.name for p in parent.iterdir()]
    except OSError:
        return ""
    near = difflib.get_close_matches(path.name, names, n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(str(parent / n) for n in near)}?" if near else ""


def one_line(e: BaseException) -> str:
    """The message of `e` as one line (onnxruntime's and transformers' span several)."""
    return " ".join(str(e).split())
