"""`sharp-bench export`: onnxruntime CPU latency of sharp-exported files, per norm and fallback (dense,
streamed with 256-key blocks), against the same softmax model exported through torch's own SDPA (an
opset-23 `Attention` node) — all in one run.

Each norm also runs through sharp's native kernel library (its `--fallback none` file with the library
registered). Prefill at several lengths (batch 1) and per-token decode on a past cache; medians of repeated runs
after a warm-up. Peak memory of a long native prefill (--memory-lengths) is measured in fresh processes.
The demo models (models/zoo) are used when present; entmax / asentmax use random weights of the
same architecture (latency does not depend on training). A case whose first run exceeds --time-cap is
reported as such instead of being repeated.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
import types
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from tqdm import tqdm

from sharp.benchmarks.harness import (
    BenchParser,
    add_output,
    command_line,
    machine,
    markdown_table,
    measure,
    output_page,
    run_isolated,
    today,
    write_section,
)
from sharp.exporter.cli import quiet_libraries
from sharp.exporter.export import ExportSettings, GenerationGraph, export_model, io_names, with_norm
from sharp.models.checkpoint import load, zoo_dir, zoo_model
from sharp.models.config import ModelConfig
from sharp.models.layers import SharpAttention, use_custom_op
from sharp.models.lm import SharpLM
from sharp.models.positional import apply_rope, rope_angles
from sharp.plugins.onnxruntime import NativeOpUnavailable, build, check_runs_here, library_isa, library_path


def _sdpa_forward(self: SharpAttention, x, positions, cache=None, key_mask=None, impl="reference"):
    """Softmax attention through F.scaled_dot_product_attention (the baseline's export path; no entropy)."""
    b, length, _ = x.shape
    cfg = self.cfg
    q = self.q_proj(x).view(b, length, cfg.heads, cfg.head_dim).transpose(1, 2)
    k = self.k_proj(x).view(b, length, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
    v = self.v_proj(x).view(b, length, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
    cos, sin = rope_angles(positions, cfg.head_dim, cfg.rope_base, cfg.rope_scaling)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if cache is not None:
        k, v = torch.cat((cache[0], k), dim=2), torch.cat((cache[1], v), dim=2)
    lk = k.shape[2]
    qpos = torch.arange(length, device=x.device) + (lk - length)
    mask = torch.arange(lk, device=x.device).view(1, -1) <= qpos.view(-1, 1)
    if key_mask is not None:
        mask = mask & key_mask[:, None, None, :]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out = out.transpose(1, 2).reshape(b, length, cfg.heads * cfg.head_dim)
    return self.o_proj(out), (k, v), torch.zeros(b, cfg.heads, length, device=x.device)


def export_sdpa_baseline(model: SharpLM, path: Path) -> Path:
    """The softmax model with SDPA attention, exported at opset 23 (ONNX `Attention`)."""
    if model.cfg.pos != "rope" or model.cfg.kv_heads != model.cfg.heads:
        raise ValueError("the SDPA baseline covers RoPE models without GQA (the demo models' architecture)")
    wrapper = GenerationGraph(model, kv_cache=True).eval()
    use_custom_op(model, on=False)
    for m in model.modules():
        if isinstance(m, SharpAttention):
            m.forward = types.MethodType(_sdpa_forward, m)
    from sharp.exporter.export import _dynamic_shapes, example_inputs

    inputs, outputs = io_names(model.cfg.layers, True)
    with torch.no_grad():
        program = torch.onnx.export(
            wrapper,
            example_inputs(model.cfg.shape, True),
            dynamo=True,
            input_names=inputs,
            output_names=outputs,
            dynamic_shapes=_dynamic_shapes(model.cfg.layers, True),
            opset_version=23,
            optimize=True,
            verbose=False,
        )
    for m in model.modules():
        if isinstance(m, SharpAttention):
            del m.forward  # back to the class's own forward
    onnx.save(program.model_proto, path)
    return path


def _session(path: Path, threads: int, library: str | None = None):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    if library:
        opts.register_custom_ops_library(library)
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


SDPA_MEMORY_MAX = 8192  # onnxruntime's CPU Attention holds (heads, L, L) scores: 16 GiB at 32,768 tokens


def memory_case(case: dict) -> dict:
    """In a fresh process: peak extra resident memory (MiB) of one prefill of case["length"] tokens."""
    sess = _session(Path(case["path"]), case["threads"], case.get("library"))
    cfg = types.SimpleNamespace(layers=case["layers"], kv_heads=case["kv_heads"], head_dim=case["head_dim"])
    feed = _feeds(cfg, case["length"], 0)
    result = measure(lambda: sess.run(None, feed), 1)
    return {"peak_mib": result["peak_mib"], "seconds": result["median_s"]}


def _feeds(cfg: ModelConfig, new: int, past: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    feed = {
        "input_ids": rng.integers(0, 256, (1, new)).astype(np.int64),
        "attention_mask": np.ones((1, past + new), np.int64),
        "position_ids": (np.arange(new) + past).reshape(1, new).astype(np.int64),
    }
    for i in range(cfg.layers):
        for kind in ("key", "value"):
            feed[f"past_key_values.{i}.{kind}"] = rng.standard_normal((1, cfg.kv_heads, past, cfg.head_dim)).astype(
                np.float32
            )
    return feed


def _time_ms(sess, feed, repeats: int, cap_s: float) -> str | float:
    t0 = time.perf_counter()
    sess.run(None, feed)  # warm-up, and the cap check
    first = time.perf_counter() - t0
    if first > cap_s:
        return f"> {cap_s:.0f} s"
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sess.run(None, feed)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _models() -> dict[str, tuple[SharpLM, str]]:
    """norm → (model to export, where it came from)."""
    arch = dict(layers=4, heads=4, dim=128, pos="rope", context_length=16384)
    if (zoo_dir() / "softmax.pt").is_file() and (zoo_dir() / "ssa.pt").is_file():
        softmax, ssa, src = load(zoo_model("softmax")), load(zoo_model("ssa")), "demo model"
    else:
        torch.manual_seed(0)
        softmax, ssa, src = (
            SharpLM(ModelConfig(norm="softmax", **arch)),
            SharpLM(ModelConfig(norm="ssa", **arch)),
            "random",
        )
    softmax.cfg.context_length = ssa.cfg.context_length = 16384
    torch.manual_seed(0)
    return {
        "softmax": (softmax, src),
        "adaptive": (with_norm(softmax, "adaptive"), f"{src}, softmax twin"),
        "ssmax": (with_norm(softmax, "ssmax", ssmax_s=0.3), f"{src}, softmax twin"),
        "ssa": (ssa, src),
        "entmax": (SharpLM(ModelConfig(norm="entmax", **arch)).eval(), "random weights"),
        "asentmax": (SharpLM(ModelConfig(norm="asentmax", **arch)).eval(), "random weights"),
    }


def _native_libraries(isas: list[str] | None, tmp: Path) -> dict[str, str]:
    """ISA → native library: the one this CPU loads by default; with `isas`, the installed variant of each -march
    where there is one, else a library built for it into `tmp` (headers as `make install` fetched them)."""
    if not isas:
        path = library_path()
        return {library_isa(path): path}
    out = {}
    for isa in isas:
        installed = build.VARIANTS.get(isa)
        if installed is not None and installed.exists():
            out[isa] = str(installed)
        else:
            out[isa] = str(build.build(tmp / f"libsharp_ort.{isa}.so", march=isa))
        check_runs_here(out[isa])
    return out


def run(argv: list[str] | None = None) -> int:
    ap = BenchParser(prog="sharp-bench export", description=__doc__)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--decode-past", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--time-cap", type=float, default=60.0, help="seconds: longer first runs are not repeated")
    ap.add_argument("--fallbacks", nargs="+", choices=["dense", "streamed"], default=["dense", "streamed"])
    ap.add_argument("--no-native", dest="native", action="store_false", help="leave out the native kernel rows")
    ap.add_argument("--memory-lengths", type=int, nargs="*", default=[8192, 32768])
    ap.add_argument("--isas", nargs="+", metavar="MARCH", help="native kernel rows per -march, side by side (e.g. "
                    "x86-64-v2 x86-64-v3 native; the installed variants are used, others built for the run); default: "
                    "the library this CPU loads")  # fmt: skip
    add_output(ap)
    args = ap.parse_args(argv)
    args.command = command_line("export", [] if argv is None else list(argv))
    if args.isas and not args.native:
        ap.error("--isas measures the native kernel, which --no-native leaves out")
    natives: dict[str, str] = {}  # row label suffix → library
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        if args.native:
            try:
                natives = _native_libraries(args.isas, Path(tmp))
            except (NativeOpUnavailable, build.BuildError) as e:
                print(f"sharp-bench export: {e} (--no-native measures the fallbacks alone)", file=sys.stderr)
                return 1
        models = _models()
        rows = []
        quiet_libraries()  # torch.onnx's notes about itself, as sharp-export silences them
        files = {
            "SDPA baseline (softmax, opset 23 Attention)": export_sdpa_baseline(
                models["softmax"][0], Path(tmp) / "sdpa.onnx"
            )
        }
        libraries: dict[str, str] = {}
        for norm, (model, _) in models.items():
            for fallback in [*args.fallbacks, "none"] if natives else args.fallbacks:
                path = Path(tmp) / f"{norm}-{fallback}.onnx"
                onnx.save(export_model(model, ExportSettings(norm=norm, fallback=fallback)), path)
                if fallback != "none":
                    files[f"sharp {norm} ({fallback} fallback)"] = path
                for isa, library in natives.items() if fallback == "none" else ():
                    label = f"sharp {norm} (native kernel, {isa})"
                    files[label], libraries[label] = path, library
        cfg = models["softmax"][0].cfg
        base: dict[str, float] = {}
        for label, path in tqdm(files.items(), desc="export", unit="file"):
            sess = _session(path, args.threads, libraries.get(label))
            cells = []
            for key, feed in [(f"prefill {n}", _feeds(cfg, n, 0)) for n in args.lengths] + [
                (f"decode @{args.decode_past}", _feeds(cfg, 1, args.decode_past))
            ]:
                ms = _time_ms(sess, feed, args.repeats, args.time_cap)
                if label.startswith("SDPA") and isinstance(ms, float):
                    base[key] = ms
                ratio = (
                    f" ({ms / base[key]:.2f}×)"
                    if isinstance(ms, float) and key in base and not label.startswith("SDPA")
                    else ""
                )
                cells.append(f"{ms:,.1f}{ratio}" if isinstance(ms, float) else ms)
            rows.append([label, *cells])
        memory_rows = []
        sdpa_label = next(iter(files))
        first = next(iter(natives), "")  # peak memory does not depend on the ISA: the first one's rows
        labels = [sdpa_label, *(f"sharp {norm} (native kernel, {first})" for norm in models)]
        for label in labels if natives and args.memory_lengths else ():
            cells = []
            for n in args.memory_lengths:
                if label == sdpa_label and n > SDPA_MEMORY_MAX:
                    cells.append("not run (L × L scores)")
                    continue
                case = dict(
                    path=str(files[label]),
                    library=libraries.get(label),
                    threads=args.threads,
                    length=n,
                    layers=cfg.layers,
                    kv_heads=cfg.kv_heads,
                    head_dim=cfg.head_dim,
                )
                r = run_isolated("sharp.benchmarks.export", case)
                cells.append(r.get("error") or f"{r['peak_mib']:,.0f} MiB ({r['seconds']:.1f} s)")
            memory_rows.append([label, *cells])
    header = ["file", *(f"prefill {n:,} ms" for n in args.lengths), f"decode @{args.decode_past:,} ms/token"]
    sources = ", ".join(f"{n}: {src}" for n, (_, src) in models.items())
    body = "\n".join(
        [
            "## Export: onnxruntime CPU latency" + (", the native kernel per instruction set" if args.isas else ""),
            "",
            f"Measured {today()} on {machine()}, onnxruntime CPU, {args.threads} threads. Command: {args.command}.",
            f"Batch 1; prefill from an empty cache; decode = one token after {args.decode_past:,} cached; median of"
            f" {args.repeats} runs after a warm-up; (×) = time / SDPA baseline."
            f" Models (4 layers, 4 heads, dim 128): {sources}.",
            "",
            markdown_table(header, rows),
            *(
                [
                    "",
                    "Peak extra resident memory of one prefill (fresh process per cell; the file's KV-cache"
                    " outputs and logits included, time in brackets):",
                    "",
                    markdown_table(["file", *(f"prefill {n:,}" for n in args.memory_lengths)], memory_rows),
                ]
                if memory_rows
                else []
            ),
        ]
    )
    print(body)
    if (page := output_page(args)) is not None:
        write_section("export --isas" if args.isas else "export", body, page)  # its own section beside the default
    return 0


if __name__ == "__main__":  # a memory case, in the fresh process run_isolated starts
    print(json.dumps(memory_case(json.loads(sys.argv[1]))))
