"""`sharp-serve MODEL`: serve a model over gRPC (and the OpenAI-compatible HTTP API with --http-port).

Mistakes exit 2 with one line saying what was wrong and what is allowed; SIGTERM (or Ctrl-C) drains the server:
health goes NOT_SERVING, new calls get UNAVAILABLE, in-flight calls finish within --drain-timeout, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import re
import signal
import sys
from pathlib import Path

from sharp.models.messages import Parser, UsageError
from sharp.serving import logs
from sharp.serving.credentials import auth_token, tls_pair
from sharp.serving.logs import FORMATS, LEVELS


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written; each option's default after its help (when it has one)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or isinstance(action.default, bool):
            return action.help  # "(default: None)" and flags' False say nothing
        return super()._get_help_string(action)


class _Given(argparse.Action):
    """Store the value and note that the flag was given (`args.given`): a port left at its default is a preference,
    a port given is a requirement (`_yielding_defaults`)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        namespace.given = {*getattr(namespace, "given", ()), self.dest}


DEFAULT_PORTS = ("port", "metrics_port")  # the listeners with a fixed default port


def _config_flags(ap: argparse.ArgumentParser, config_type) -> None:
    """A flag per config field made with `option` (serving/config.py): `--name-with-dashes`, the field's type,
    default and help — the one source of each setting."""
    for f in dataclasses.fields(config_type):
        if "help" in f.metadata:
            kind = {"int": int, "float": float}.get(f.type.split(" |")[0], str)
            action = _Given if f.name in DEFAULT_PORTS else "store"
            ap.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default, help=f.metadata["help"],
                            action=action)  # fmt: skip


def _yielding_defaults(server, given: set[str], say=print):
    """`server` with its defaulted ports made to yield, so a second server on one machine starts as the first did:
    with the HTTP API on, /metrics is on its port and no metrics port of its own is opened unless --metrics-port is
    given; a default port (gRPC's 50051, metrics' 9400) that is taken becomes any free one, said in a line (the
    listening line names it). A port given on the command line is never changed: taken, start-up fails naming it."""
    from sharp.serving.api.server import bind_problem

    changes: dict[str, int | None] = {}
    if "metrics_port" not in given and server.http_port is not None:
        changes["metrics_port"] = None
    for name in DEFAULT_PORTS:
        port = changes.get(name, getattr(server, name))
        host = (server.metrics_host if name == "metrics_port" else None) or server.host
        if name not in given and port and "already in use" in (bind_problem(host, port) or ""):
            changes[name] = 0
            say(f"sharp-serve: {host}:{port} (the default --{name.replace('_', '-')}) is taken; listening on a free"
                " port instead")  # fmt: skip
    return dataclasses.replace(server, **changes)


def _configured(config_type, args, **rest):
    """The config from its flags (and `rest`), checked by its own `check()`; a refusal names the flag."""
    flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(config_type) if "help" in f.metadata}
    config = config_type(**flags, **rest)
    try:
        config.check()
    except ValueError as e:
        raise UsageError(re.sub(r"`(\w+)`", lambda m: "--" + m[1].replace("_", "-"), str(e))) from None
    return config


def serve_parser() -> argparse.ArgumentParser:
    # the serving side only: the client never loads torch
    from sharp.serving.api.server import ServerConfig
    from sharp.serving.backends.interface import BACKENDS, DTYPES
    from sharp.serving.config import EngineConfig
    from sharp.serving.metrics import ENTROPY_MODES, METRIC_NAMES

    ap = Parser(prog="sharp-serve", description=__doc__, formatter_class=_HelpFormatter)
    ap.add_argument(
        "model",
        type=Path,
        help="an .onnx file from sharp-export, a GGUF file, or a Hugging Face model directory (onnxruntime: exported"
        " once, checked,"
        " into $SHARP_CACHE, default ~/.cache/sharp), a model.pt (torch), an engine (tensorrt)",
    )
    ap.add_argument(
        "--backend",
        choices=BACKENDS,
        help="default: torch for a Hugging Face directory or a GGUF with --device cuda (sharp's paged Triton kernels),"
        " onnxruntime otherwise",
    )
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    _config_flags(ap, ServerConfig)
    ap.add_argument(
        "--metrics-port",
        type=int,
        action=_Given,
        default=ServerConfig.metrics_port,
        help="Prometheus port (0: any free port; -1: off); with --http-port, off unless given (/metrics is on the HTTP"
        " port). A default port (this one, --port's) that is taken becomes any free one; a port given must be free",
    )
    ap.add_argument(
        "--served-model-name",
        "--model-name",
        nargs="+",
        metavar="NAME",
        help="the ids clients send as `model` (vLLM's flag): the first in replies, metrics and GetModelInfo, the others"
        " aliases (default: the model's own name, kept by sharp-export from the directory or file it exported; else"
        " the file's stem)",
    )
    _config_flags(ap, EngineConfig)
    ap.add_argument(
        "--entropy-metrics",
        choices=ENTROPY_MODES,
        default="auto",
        help="entropy histogram labels: per head, per layer, off; auto: per head up to 256 (layer, head) pairs",
    )
    ap.add_argument(
        "--metrics-names",
        choices=METRIC_NAMES,
        default="sharp",
        help="vllm: also the vllm: load series (running, waiting, KV cache use, cache shape) that routers and the"
        " inference gateway's endpoint picker read",
    )
    ap.add_argument(
        "--warm-up",
        choices=["auto", "on", "off"],
        default="auto",
        help="run the model's prefill and decode shapes (kernel compiles, tile tuning) before health reports SERVING;"
        " auto: on with --device cuda",
    )
    ap.add_argument(
        "--engine-process",
        choices=["auto", "on", "off"],
        default="auto",
        help="run the engine (scheduler, model, output) in its own process, fed over a pipe; off: in the server's;"
        " auto: on where the model runs on a GPU (tensorrt, onnxruntime --device cuda), off on CPU (the runtime's"
        " threads take every core: the process hop costs more than it frees) and for torch",
    )
    ap.add_argument("--log-level", choices=LEVELS, default="info", help="server log lines on stderr from this level")
    ap.add_argument("--log-format", choices=FORMATS, default="text", help="text, or one JSON object per line")
    ap.add_argument("--auth-token-file", type=Path, help="require `authorization: Bearer <token>` (health exempt)")
    ap.add_argument("--tls-cert", type=Path, help="PEM certificate chain (with --tls-key)")
    ap.add_argument("--tls-key", type=Path, help="PEM private key (with --tls-cert)")
    ap.add_argument(
        "--native",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run attention with sharp's native onnxruntime kernel when it is built (--no-native: the file's "
        "fallback bodies, for comparison)",
    )
    ap.add_argument("--ort-op-library", help="another sharp::SharpAttention library for onnxruntime (overrides)")
    ap.add_argument("--threads", type=int, default=0, help="onnxruntime intra-op threads (0: all cores)")
    ap.add_argument(
        "--dtype",
        choices=list(DTYPES),
        help="torch backend: weights and KV cache (default: bf16 on cuda, fp32 on cpu)",
    )
    ap.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        help="torch backend: decode steps replayed from CUDA graphs, one per batch-size bucket (default: on with"
        " --device cuda; a step with more sequences than the largest bucket runs eagerly)",
    )
    ap.add_argument(
        "--sparse-decode",
        action="store_true",
        help="torch backend, entmax-family model: decode steps read only the KV pages that can carry weight, in"
        " torch on CPU and in the Triton paged kernel on a GPU (exact; keeps per-page key bounds, 1/8 of fp32 keys;"
        " no CUDA graphs). Off by default: on CPU it is slower than reading every page up to 16K keys"
        " (docs/benchmarks.md); on a GPU it is not measured yet",
    )
    return ap


def build_server(args):
    """The (engine, ServerConfig) for parsed sharp-serve arguments; raises UsageError/BackendError."""
    from sharp.exporter.metadata import NAME, NAME_RULE, source_name
    from sharp.serving.api.server import ServerConfig
    from sharp.serving.backends.loading import check_model_path, default_backend, exported, is_model_source
    from sharp.serving.config import EngineConfig
    from sharp.serving.engine.core import CoreSpec, EngineProcess, build_engine

    if bool(args.tls_cert) != bool(args.tls_key):
        raise UsageError("--tls-cert and --tls-key go together; give both or neither")
    if not -1 <= args.metrics_port <= 65535:
        raise UsageError(f"--metrics-port must be in [-1, 65535] (0: any free port, -1: off), got {args.metrics_port}")
    names = tuple(args.served_model_name or ())
    for name in names:
        if not NAME.fullmatch(name):
            raise UsageError(f"--served-model-name {name!r}: {NAME_RULE}")
    if len(set(names)) < len(names):
        raise UsageError(f"--served-model-name names one id twice: {' '.join(names)}")
    if args.threads < 0:
        raise UsageError(f"--threads must be >= 0 (0: all cores), got {args.threads}")
    config = _configured(EngineConfig, args)
    cert, key = tls_pair(args.tls_cert, args.tls_key)
    server = _configured(
        ServerConfig,
        args,
        metrics_port=None if args.metrics_port < 0 else args.metrics_port,
        auth_token=auth_token(args.auth_token_file),
        tls_cert=cert,
        tls_key=key,
        warm_up=args.warm_up == "on" or (args.warm_up == "auto" and args.device == "cuda"),
    )
    if args.backend is None:
        args.backend = default_backend(args.model, args.device)
    if args.cuda_graphs is not None and args.backend != "torch":
        raise UsageError(f"--cuda-graphs applies to --backend torch, not {args.backend}")
    if args.sparse_decode and args.backend != "torch":
        raise UsageError(f"--sparse-decode applies to --backend torch, not {args.backend}")
    if args.dtype is not None and args.backend != "torch":
        raise UsageError(f"--dtype applies to --backend torch (the {args.backend} file fixes its own precision)")
    kw = {
        "onnxruntime": {"op_library": args.ort_op_library, "threads": args.threads, "native": args.native},
        "torch": {"dtype": args.dtype, "graphs": args.cuda_graphs, "sparse": args.sparse_decode},
    }.get(args.backend, {})
    model = check_model_path(args.model, args.backend)  # said before a process starts
    server = _yielding_defaults(server, getattr(args, "given", set()), say=lambda line: print(line, flush=True))
    if (busy := server.busy_port()) is not None:  # before an export of minutes, not after it
        raise UsageError(busy)
    if is_model_source(model):  # a Hugging Face directory or a GGUF: served under its own name (onnxruntime's export
        if not names and (given := source_name(model)):  # cache is by content: another copy's name is not this one)
            names = (given,)
        if args.backend == "onnxruntime":
            model = exported(model, say=lambda line: print(line, flush=True))
    spec = CoreSpec(str(model), args.backend, args.device, kw, names, config, args.entropy_metrics,
                    args.metrics_names, args.log_level, args.log_format)  # fmt: skip
    on_gpu = args.backend == "tensorrt" or (args.backend == "onnxruntime" and args.device == "cuda")
    if args.engine_process == "off" or (args.engine_process == "auto" and not on_gpu):
        try:
            return build_engine(spec), server
        except ValueError as e:  # a setting the model's own sizes rule out (its context)
            raise UsageError(re.sub(r"`(\w+)`", lambda m: "--" + m[1].replace("_", "-"), str(e))) from None
    return EngineProcess(spec), server


async def _serve(engine, config) -> int:
    """Serve until a signal drains the server (0) or the engine's process dies (1: its clients were told)."""
    from sharp.serving.api.server import SharpServer

    server = SharpServer(engine, config)
    try:
        await server.start()
    except BaseException:
        engine.stop()  # an engine process must not outlive a server that never served
        raise
    if server.warm_up is not None:
        w = server.warm_up
        print(
            f"sharp-serve: warm-up {w.seconds:.1f} s ({w.prefill_chunks} prefill chunks, {w.decode_steps} decode steps,"
            f" sequences up to {w.longest} tokens)",
            flush=True,
        )
    loop = asyncio.get_running_loop()
    draining = asyncio.Event()

    def on_signal() -> None:
        if draining.is_set():  # a second SIGTERM / Ctrl-C: stop waiting for the drain
            print("sharp-serve: second signal, exiting without draining", file=sys.stderr, flush=True)
            os._exit(1)
        draining.set()

    for sig in (signal.SIGTERM, signal.SIGINT):  # before the line that says we listen: a signal after it drains
        loop.add_signal_handler(sig, on_signal)
    spec = engine.spec
    where = config.metrics_host or config.host
    metrics = f", metrics http://{where}:{server.metrics_port}/metrics" if server.metrics_port else ""
    if server.health_port:
        metrics += f", plaintext health {config.host}:{server.health_port}"
    if server.http_port:
        scheme = "https" if config.tls_cert else "http"
        metrics += f", OpenAI API {scheme}://{config.http_host or config.host}:{server.http_port}/v1"
    print(
        f"sharp-serve: {spec.name} ({spec.backend}, norm {spec.norm}, {spec.layers} layers × {spec.heads} heads)"
        f" on {config.host}:{server.port}{metrics}",
        flush=True,
    )
    crashed = asyncio.Event()
    engine.on_exit(lambda: loop.call_soon_threadsafe(crashed.set))
    waiter = asyncio.ensure_future(server.wait())
    stopper = asyncio.ensure_future(draining.wait())
    crash = asyncio.ensure_future(crashed.wait())
    await asyncio.wait({waiter, stopper, crash}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if crashed.is_set():
        print(f"sharp-serve: the engine process exited (code {engine.exit_code}); stopping", file=sys.stderr,
              flush=True)  # fmt: skip
        deadline = loop.time() + 5  # the failed calls' statuses reach their clients first
        while server.calls.inflight and loop.time() < deadline:
            await asyncio.sleep(0.02)
        await server.stop()
        code = 1
    elif draining.is_set():
        print("sharp-serve: draining", flush=True)
        await server.drain()
    waiter.cancel()
    stopper.cancel()
    crash.cancel()
    print("sharp-serve: stopped", flush=True)
    return code


def serve_main(argv: list[str] | None = None) -> int:
    from sharp.models.messages import one_line
    from sharp.serving.backends.interface import BackendError
    from sharp.serving.engine.core import CoreExited

    args = serve_parser().parse_args(argv)
    try:
        engine, config = build_server(args)
    except (UsageError, BackendError) as e:
        print(f"sharp-serve: {one_line(e)}", file=sys.stderr)
        return 2
    except CoreExited as e:
        print(f"sharp-serve: {one_line(e)}", file=sys.stderr)
        return 1
    from sharp.serving.engine.warmup import WarmUpError

    restore = logs.configure(args.log_level, args.log_format)
    try:
        return asyncio.run(_serve(engine, config))
    except OSError as e:
        print(f"sharp-serve: {one_line(e)}", file=sys.stderr)
        return 2
    except WarmUpError as e:
        print(f"sharp-serve: warm-up failed, not serving: {one_line(e)}", file=sys.stderr)
        return 1
    finally:
        restore()


if __name__ == "__main__":
    raise SystemExit(serve_main())
