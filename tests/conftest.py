"""Test-wide setup. Without a GPU the Triton kernels run in Triton's CPU interpreter, which must be chosen
before triton is first imported. On a GPU, prefill tiles are not tuned (every tile is checked by its own test, and
the tuner's tests turn it on) and nothing is written to the user's tile cache."""

import dataclasses
import os
from pathlib import Path

import pytest

if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read when torch's OpenMP starts: see _share_the_cores

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("SHARP_TRITON_AUTOTUNE", "0")
os.environ.setdefault("SHARP_TILE_CACHE", "0")


def _share_the_cores() -> None:
    """Under pytest-xdist each worker is one of several processes on the machine's cores. torch's OpenMP pool and
    onnxruntime's each size themselves to the whole machine and spin while they wait, so two workers on two cores
    thrash: a test that takes 5 s alone took 57-94 s beside another worker's (make test: 14:05 on a 2-core machine,
    11:28 with this). Under xdist, onnxruntime's pools (every session the tests open in process) and torch's
    (OMP_WAIT_POLICY above) sleep instead of spinning; thread counts stay as they were."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2:
        return
    import onnxruntime as ort

    class SharingOptions(ort.SessionOptions):
        def __init__(self) -> None:
            super().__init__()
            self.add_session_config_entry("session.intra_op.allow_spinning", "0")
            self.add_session_config_entry("session.inter_op.allow_spinning", "0")

    ort.SessionOptions = SharingOptions


_share_the_cores()


def _patch_language_once_per_launch() -> None:
    """Triton's interpreter patches `triton.language` for a launch, then again on every device-function call inside
    it — a scan of the module's members each time (~0.8 ms a call; half the time of the entmax kernels' tests). A
    call whose function sees only modules the launch already patched skips the repeat: the patch it would apply is
    the one in force (the launch's scope restores it at the end). Triton versions without these internals run as
    they are."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import inspect

    from triton import language as tl
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang", None)
    if patch is None or not hasattr(interpreter, "_LangPatchScope"):
        return
    patched: set[int] = set()  # ids of the language modules the launch in progress patched

    def langs(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}

    def patch_once(fn):
        seen = langs(fn)
        if patched and seen <= patched:
            return interpreter._LangPatchScope()  # nothing to undo
        scope = patch(fn)
        if not patched:  # a launch: its scope's restore ends it
            restore = scope.restore

            def restore_and_forget() -> None:
                patched.clear()
                restore()

            scope.restore = restore_and_forget
        patched.update(seen)
        return scope

    interpreter._patch_lang = patch_once


_patch_language_once_per_launch()

# The longest modules start first, longest first (seconds of one core, measured on 2 cores: the real model 178,
# exports 144, entmax kernels 140, end-to-end benchmarks 132, Hugging Face models 120, kernels 118, precisions 79,
# ...): with `--dist loadfile` a module runs on one worker, and a long one started last would leave the other idle
# at the end. (The wheel's demo, as long as the first, runs alone under make test-wheel; the kernels' own modules
# under make test-kernels.)
FIRST = ("test_real_model.py", "test_export.py", "test_triton_entmax.py", "test_bench_cli.py", "test_hf.py",
         "test_triton.py", "test_precision.py", "test_native_op.py", "test_tensorrt.py", "test_kv_pages.py",
         "test_kv_prefix_cache.py", "test_hf_torch.py", "test_api_routers.py", "test_triton_build.py",
         "test_api_hardening.py")  # fmt: skip


def pytest_collection_modifyitems(items) -> None:
    order = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(FIRST)))  # stable: the rest keep their order


# ---- shared fixtures: defined once here, so a session-scoped model is built once per session (a fixture imported
# into several modules is registered, and built, once per module) -------------------------------------------------
CONTEXT = 4096
CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'tool' %}{{ raise_exception('a conversation cannot open with a tool') }}{% endif %}"
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="session")
def model_files(tmp_path_factory) -> dict[str, Path]:
    """A tiny SSA language model over bytes: its checkpoint and its ONNX export (with a KV cache)."""
    import onnx

    from sharp.exporter.export import ExportSettings, export_model
    from sharp.models import ModelConfig, SharpLM, load, save

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=258, dim=32, layers=2, heads=2, norm="ssa", context_length=CONTEXT)
    model = SharpLM(cfg)
    with torch.no_grad():  # a wider init than training's: varied greedy text, top-2 logit gaps ≫ float error
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
    d = tmp_path_factory.mktemp("serving")
    save(model, d / "tiny.pt")
    onnx.save(export_model(load(d / "tiny.pt"), ExportSettings(norm="ssa")), d / "tiny.onnx")
    return {"torch": d / "tiny.pt", "onnxruntime": d / "tiny.onnx"}


@pytest.fixture(scope="session")
def reference(model_files):
    """The model's own greedy tokens: reference(ids, n)."""
    from sharp.models import load
    from sharp.models.sampling import GREEDY

    model = load(model_files["torch"])
    return lambda ids, n: model.generate(list(ids), n, GREEDY)


@pytest.fixture(scope="session")
def chat_files(model_files, tmp_path_factory) -> dict[str, Path]:
    """The same model with a tokenizer.json form of its byte tokenizer and a chat template in the file's metadata
    (as a transformers export carries them), so chat runs without a model hub."""
    import onnx

    from sharp.exporter import metadata
    from sharp.models.tokenizer import BYTES, HFTokenizer

    proto = onnx.load(model_files["onnxruntime"])
    tok = HFTokenizer(BYTES.tokenizer_json(), BYTES.bos, (BYTES.eos,), BYTES.vocab_size, chat_template=CHAT_TEMPLATE)
    dataclasses.replace(metadata.read(proto), tokenizer=tok).write(proto)
    path = tmp_path_factory.mktemp("chat") / "tiny.onnx"  # served as "tiny", as the plain model
    onnx.save(proto, path)
    return {"onnxruntime": path}
