"""Measurement helpers shared by every `sharp-bench` command: timing, peak memory, the benchmarks page.

Peak memory on CPU is the process's resident high-water mark (VmHWM) above its resident size before the
call, with the mark reset through /proc/self/clear_refs; each case runs in a fresh subprocess started with a
fixed glibc mmap threshold, so large temporaries are returned to the system and earlier cases cannot hide in
the allocator's free lists.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

DOCS_PAGE = Path("docs/benchmarks.md")


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure(fn: Callable[[], object], repeats: int) -> dict:
    """Run fn `repeats` times: median and all wall times (s), and the peak extra resident memory (MiB) of run 1."""
    rss_before = _status_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    peak_mib = (_status_kb("VmHWM") - rss_before) / 1024
    return {"median_s": statistics.median(times), "times_s": times, "peak_mib": peak_mib}


def run_isolated(module: str, case: dict, timeout_s: float = 3600) -> dict:
    """Run `python -m module <case json>` in a fresh process; it prints one JSON line with its result."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    proc = subprocess.run(
        [sys.executable, "-m", module, json.dumps(case)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout_s,
        check=False,
    )
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"error": f"exit {proc.returncode}: {tail[0]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def machine() -> str:
    """One line saying what the numbers were measured on."""
    cpu = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            names = re.findall(r"model name\s*:\s*(.+)", f.read())
        cpu = names[0].strip() if names else cpu
    except OSError:
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{cpu}, {os.cpu_count()} cores, {mem_gib:.0f} GiB RAM, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), Python {platform.python_version()}"
    )


def today() -> str:
    return dt.date.today().isoformat()


class BenchParser(argparse.ArgumentParser):
    """A mistake is one line naming it (exit 2), as every sharp command answers; --help still shows the usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message}\n")


def add_output(ap: argparse.ArgumentParser, page: Path = DOCS_PAGE) -> None:
    ap.add_argument(
        "--write",
        type=Path,
        metavar="PATH",
        help=f"the markdown page to update (default: {page} when run in a sharp checkout; elsewhere nothing is"
        " written without --write)",
    )
    ap.add_argument("--no-write", action="store_true", help="print only")


def in_checkout(where: Path | None = None) -> bool:
    """Whether `where` (the working directory) is a sharp source checkout, whose docs/ the default page is."""
    root = where or Path.cwd()
    project = root / "pyproject.toml"
    return project.is_file() and 'name = "sharp-attention"' in project.read_text() and (root / "docs").is_dir()


def output_page(args: argparse.Namespace, page: Path = DOCS_PAGE) -> Path | None:
    """The page a run updates: --write PATH, else `page` inside a sharp checkout, else none (said on stderr)."""
    if args.no_write:
        return None
    if args.write is not None:
        return args.write
    if in_checkout():
        return page
    print(f"sharp-bench: not in a sharp checkout, so {page} is not written (--write PATH to keep the results)",
          file=sys.stderr)  # fmt: skip
    return None


def command_line(name: str, argv: list[str]) -> str:
    """The command as it was given, for the page: `sharp-bench NAME ARGS…`."""
    return "`" + shlex.join(["sharp-bench", *name.split(), *argv]) + "`"


def write_section(name: str, body: str, page: Path = DOCS_PAGE, title: str = "Benchmarks") -> None:
    """Replace (or append) the section of a docs page that belongs to `sharp-bench <name>`."""
    start, end = f"<!-- sharp-bench {name} -->", f"<!-- /sharp-bench {name} -->"
    block = f"{start}\n{body.rstrip()}\n{end}"
    intro = f"# {title}\n\nWritten by `sharp-bench`; each section is replaced when its command runs again.\n"
    text = page.read_text() if page.exists() else intro
    if start in text and end in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(text)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)
