"""Build a wheelhouse for installing sharp with no network: sharp's wheel (generated gRPC modules and the native
ONNX Runtime library inside) plus the wheels of what it needs, for a given Python and platform, at the versions
this environment runs — the tested ones. torch is left out: GPU machines bring their own CUDA build.

    python deploy/wheelhouse.py build/wheelhouse --python 3.12                       # everything but torch
    python deploy/wheelhouse.py build/wh --python 3.12 --only protobuf grpcio grpcio-health-checking grpcio-reflection

Then, on the machine without network (the command is printed at the end):

    pip install --no-index --find-links build/wheelhouse sharp-attention          # a full wheelhouse
    pip install --no-index --no-deps --target /tmp/site build/wh/*.whl              # an --only one, beside a CUDA image

Run with the project's venv (`make wheelhouse`); needs PyPI for the downloads.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LEFT_OUT = {"torch"}  # GPU images carry their own CUDA build of it
# Linux x86-64 tags pip accepts, newest first: pip matches each exactly, so a wheel built for glibc 2.31, 2.28, 2.27 or
# 2.17 fits (llguidance 1.9 ships for 2.31 only; the GPU image's Python 3.12.3 is Ubuntu 24.04's, glibc 2.39)
DEFAULT_PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (31, 28, 27, 17)] + ["manylinux2014_x86_64", "linux_x86_64"]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def build_sharp_wheel(out: Path) -> Path:
    """sharp's wheel from a copy of the tracked files (the build never writes into the checkout)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
        for name in tracked.stdout.split():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(out), str(src)], check=True)  # fmt: skip
    return next(out.glob("sharp_attention-*.whl"))


def runtime_requirements(wheel: Path) -> list[str]:
    """The names of the wheel's unconditional requirements (no extras), torch left out."""
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    names = []
    for line in meta.splitlines():
        if line.startswith("Requires-Dist:") and "extra ==" not in line:
            names.append(canonical(re.match(r"[A-Za-z0-9_.-]+", line.split(":", 1)[1].strip()).group(0)))
    return [n for n in names if n not in LEFT_OUT]


def pinned(names: list[str]) -> list[str]:
    """NAME==VERSION as installed here; a name not installed here is an error (its tested version is unknown)."""
    out = []
    for name in names:
        try:
            out.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            raise SystemExit(f"wheelhouse: {name} is not installed here (run it with the venv's Python)") from None
    return out


def constraints() -> str:
    """Every distribution installed here at its version: transitive requirements resolve to the tested ones."""
    seen = {}
    for dist in metadata.distributions():
        name = canonical(dist.metadata["Name"] or "")
        if name and name not in LEFT_OUT | {"sharp-attention"}:
            seen[name] = dist.version
    return "".join(f"{n}=={v}\n" for n, v in sorted(seen.items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python deploy/wheelhouse.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("out", type=Path, help="directory for the wheels (created; existing wheels are kept)")
    ap.add_argument("--python", default=f"{sys.version_info.major}.{sys.version_info.minor}",
                    help="target CPython version, e.g. 3.12 (default: this one)")  # fmt: skip
    ap.add_argument("--platform", nargs="+", default=DEFAULT_PLATFORMS, help="pip platform tags of the target")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="just these packages (no dependencies), e.g. what "
                    "a CUDA image lacks; default: sharp's runtime requirements and theirs, torch left out")  # fmt: skip
    ap.add_argument("--wheel", type=Path, help="use this sharp wheel instead of building one")
    args = ap.parse_args(argv)
    if not re.fullmatch(r"3\.\d+", args.python):
        ap.error(f"--python {args.python}: give a CPython version such as 3.12")
    if args.wheel is not None and not args.wheel.is_file():
        ap.error(f"--wheel {args.wheel}: no such file")
    args.out.mkdir(parents=True, exist_ok=True)
    wheel = Path(shutil.copy2(args.wheel, args.out)) if args.wheel is not None else build_sharp_wheel(args.out)
    wanted = pinned([canonical(n) for n in args.only] if args.only else runtime_requirements(wheel))
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as pins:
        pins.write(constraints())
        pins.flush()
        command = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--python-version",
                   args.python, "--implementation", "cp", "-d", str(args.out), "-c", pins.name]  # fmt: skip
        for tag in args.platform:
            command += ["--platform", tag]
        done = subprocess.run(command + (["--no-deps"] if args.only else []) + wanted, check=False)
    if done.returncode != 0:
        print(f"wheelhouse: pip could not download wheels of {' '.join(wanted)} for CPython {args.python}",
              file=sys.stderr)  # fmt: skip
        return 1
    wheels = sorted(p.name for p in args.out.glob("*.whl"))
    print(f"{len(wheels)} wheels in {args.out}: {wheel.name} and {', '.join(w for w in wheels if w != wheel.name)}")
    if args.only:
        print(f"install: pip install --no-index --no-deps --target DIR {args.out}/*.whl")
    else:
        print(f"install: pip install --no-index --find-links {args.out} sharp-attention")
    return 0


if __name__ == "__main__":
    sys.exit(main())
