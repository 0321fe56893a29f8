"""The engine core in its own process: sharp-serve's default where the model runs on a GPU (`--engine-process`).

The API servers (gRPC, HTTP) keep validation, streams, metrics and the event loop in the server's process; a child
process owns the backend and the `Engine` (scheduler, executor, output processor) and sends each step's statistics
and events, for all its rows, as one message. The engine's Python and the event loop's no longer take turns on one
interpreter lock, and the entropy binning of the metrics happens beside the model instead of between its steps.

The transport is a `multiprocessing` pipe (a socket pair): one API process and one core need no broker, and the
pipe's end-of-file is how a crash of the core reaches every waiting client at once — each gets INTERNAL and the
server exits non-zero (serving/cli.py). Messages are pickled objects of this package's own classes, written by the
other end of the pipe; the reading side resolves only the classes of an allow-list (sharp's, numpy's, the
tokenizer's, the standard containers), so even a corrupt message cannot name anything else.

`--engine-process off` keeps the engine in the server's process (`Engine` itself): tests that put stand-in parts
into a live engine use it, and so may an embedding that builds its own backend.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import itertools
import logging
import multiprocessing
import pickle
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from sharp.serving.config import EngineConfig
from sharp.serving.engine.engine import Engine
from sharp.serving.engine.engine_client import EngineClient
from sharp.serving.engine.output import Delivery, Delta, Event, Failed, RequestState
from sharp.serving.engine.scheduler import Sequence
from sharp.serving.engine.warmup import WarmUp, WarmUpError
from sharp.serving.metrics import ServingMetrics
from sharp.serving.requests import GenerationRequest, RequestError
from sharp.serving.stats import RequestOutcome, StepStats
from sharp.serving.status import Status

log = logging.getLogger("sharp.serving")

_FUNCTIONS = {  # the few non-class globals that pickles of these messages name
    "copyreg": {"_reconstructor", "__newobj__"},
    "numpy._core.multiarray": {"_reconstruct", "scalar"},
    "numpy.core.multiarray": {"_reconstruct", "scalar"},
    "numpy._core.numeric": {"_frombuffer"},
    "numpy.core.numeric": {"_frombuffer"},
    "_codecs": {"encode"},
}
_CLASS_MODULES = {"builtins", "collections", "numpy", "numpy.dtypes", "tokenizers"}


class _Unpickler(pickle.Unpickler):
    """Resolves classes of sharp, numpy, the tokenizer and the standard containers, and the reconstructors their
    pickles use — nothing else (no functions, no dotted paths through a module's attributes)."""

    def find_class(self, module: str, name: str):
        if "." not in name:
            if name in _FUNCTIONS.get(module, ()):
                return super().find_class(module, name)
            if module in _CLASS_MODULES or module.startswith(("sharp.", "tokenizers.")):
                found = super().find_class(module, name)
                if isinstance(found, type) and not issubclass(found, BaseException | type):
                    return found
        raise pickle.UnpicklingError(f"the engine pipe does not carry {module}.{name}")


class _Pipe:
    """One end of the pipe: whole messages, sent by any thread (one at a time), read by one."""

    def __init__(self, conn):
        self.conn, self._lock = conn, threading.Lock()

    def send(self, msg: tuple) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            self.conn.send_bytes(data)

    def recv(self) -> tuple:
        return _Unpickler(io.BytesIO(self.conn.recv_bytes())).load()


@dataclass(frozen=True)
class CoreSpec:
    """What builds an engine: the model and sharp-serve's engine settings (sent to the core's process)."""

    model: str
    backend: str = "onnxruntime"
    device: str = "cpu"
    backend_options: dict = field(default_factory=dict)
    model_names: tuple[str, ...] = ()  # the served ids, the first the model's own (default: the file's name)
    config: EngineConfig = field(default_factory=EngineConfig)
    entropy: str = "auto"  # the metrics' entropy labels (serving/metrics.py)
    metric_names: str = "sharp"  # also the vllm: load series (serving/metrics.py)
    log_level: str = "info"
    log_format: str = "text"


def build_engine(spec: CoreSpec, publish=None) -> Engine:
    """The engine `spec` describes, in this process; raises BackendError (and ValueError for a bad config)."""
    from sharp.serving.backends.loading import load_backend

    backend = load_backend(spec.model, spec.backend, spec.device, **spec.backend_options)
    if spec.model_names:
        backend.spec = replace(backend.spec, name=spec.model_names[0], aliases=spec.model_names[1:])
    metrics = ServingMetrics(backend.spec, entropy=spec.entropy, names=spec.metric_names)
    return Engine(backend, spec.config, metrics, publish)


# ---- the core's process ------------------------------------------------------------------------------------------
class _Core:
    """The child's side: commands from the pipe into the engine; each step's events and statistics back."""

    def __init__(self, pipe: _Pipe):
        self.pipe = pipe
        self.engine: Engine | None = None
        self._lock = threading.Lock()  # the key maps: the reader thread adds, the engine thread's publish removes
        self._seqs: dict[int, Sequence] = {}
        self._keys: dict[RequestState, int] = {}
        self._cancelling: set[int] = set()

    def publish(self, st: StepStats, outbox: list) -> None:
        """One message per step: its statistics, every row's events, and the requests that ended (finished,
        failed or dropped after a cancel)."""
        with self._lock:
            events = [(self._keys[state], ev) for state, ev in outbox]
            ended = {k for k, ev in events if not isinstance(ev, Delta)}
            ended |= {k for k in self._cancelling if self._seqs[k].done}
            for k in ended:
                del self._keys[self._seqs.pop(k).state]
            self._cancelling -= ended
        self.pipe.send(("step", st, events, sorted(ended)))

    def serve(self) -> None:
        engine = self.engine
        while True:
            try:
                kind, *args = self.pipe.recv()
            except (EOFError, OSError):  # the server's process is gone: nothing to serve
                break
            if kind == "submit":
                key, req, arrival = args
                engine.prepare(req)  # a new grammar's matcher: never under the lock each step's publish takes
                with self._lock:  # registered before the engine thread can publish an event of it
                    seq = engine.submit(req, _no_sink, arrival)
                    self._seqs[key], self._keys[seq.state] = seq, key
            elif kind == "cancel":
                with self._lock:
                    seq = self._seqs.get(args[0])
                    if seq is not None:
                        self._cancelling.add(args[0])
                if seq is not None:
                    engine.cancel(seq)
            elif kind == "end_all":
                engine.end_all(*args)
            elif kind == "warm_up":
                try:
                    self.pipe.send(("warmed", engine.warm_up()))
                except WarmUpError as e:
                    self.pipe.send(("warm_up_failed", str(e)))
            elif kind == "start":
                engine.start()
            elif kind == "stop":
                break
        engine.stop()


def _no_sink(ev: Event) -> None:  # events cross the pipe in `publish`; the sequence's own sink is never called
    raise AssertionError("the core publishes events through its pipe")


def _core_main(conn, spec: CoreSpec) -> None:
    """The core process: build the engine, say so (or why not), then serve the pipe until told to stop."""
    from sharp.serving import logs

    for sig in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C reaches the whole group: the server drains, then stops us
        signal.signal(sig, signal.SIG_IGN)
    logs.configure(spec.log_level, spec.log_format)
    pipe = _Pipe(conn)
    core = _Core(pipe)
    try:
        core.engine = build_engine(spec, core.publish)
    except Exception as e:  # BackendError, or anything a model file can make a runtime raise
        pipe.send(("failed", type(e).__name__, str(e)))
        return
    engine = core.engine
    pipe.send(("ready", engine.spec, engine.limits, engine.attention, engine.prefix_cache))
    core.serve()


# ---- the server's side -------------------------------------------------------------------------------------------
@dataclass(eq=False)
class Handle:
    """A request submitted to the core: what `cancel` takes."""

    key: int
    sink: Callable[[Event], None]
    api: str
    arrival: float
    request_id: str = ""
    prompt_tokens: int = 0
    done: bool = False


class CoreExited(RuntimeError):
    """The core's process ended before it was told to stop."""


class EngineProcess(EngineClient):
    """The `EngineClient` of an engine in its own process. Raises the core's error when it cannot build its engine
    (BackendError for a model it cannot load)."""

    def __init__(self, spec: CoreSpec):
        spec.config.check()
        self.config = spec.config
        ctx = multiprocessing.get_context("spawn")  # never fork a process that runs threads
        mine, theirs = ctx.Pipe()
        self._process = ctx.Process(target=_core_main, args=(theirs, spec), name="sharp-engine-core", daemon=True)
        self._process.start()
        theirs.close()
        self._pipe = _Pipe(mine)
        try:
            kind, *args = self._pipe.recv()
        except (EOFError, OSError):
            self._process.join(5)
            raise CoreExited(f"the engine process exited (code {self._process.exitcode}) while loading") from None
        except BaseException:  # an unreadable answer: the core must not outlive this
            self._process.kill()
            raise
        if kind == "failed":
            self._process.join(5)
            raise _rebuilt(*args)
        self.spec, self.limits, self.attention, self.prefix_cache = args
        self.tokenizer = self.spec.tokenizer
        self.metrics = ServingMetrics(self.spec, entropy=spec.entropy, names=spec.metric_names)
        self.metrics.configured(self.config.max_queue, self.config.max_batch, self.limits)
        self.delivery = Delivery()
        self._lock = threading.Lock()  # the handles, the row count and the pipe's order of submits
        self._handles: dict[int, Handle] = {}
        self._running = 0  # rows prefilling or decoding at the core's last step
        self._keys = itertools.count()
        self._replies: queue.Queue[tuple] = queue.Queue()
        self._on_exit: list[Callable[[], None]] = []
        self._reader = threading.Thread(target=self._read, name="sharp-engine-pipe", daemon=True)
        self._reader.start()
        atexit.register(self.stop)  # before multiprocessing's own exit hook, which waits for the core forever

    # ---- the client -----------------------------------------------------------------------------------------------
    def prepare(self, req: GenerationRequest) -> None:
        """Nothing here: the core prepares a request in its own process, outside the lock its steps take (`serve`)."""

    def submit(self, req: GenerationRequest, sink: Callable[[Event], None], arrival: float | None = None) -> Handle:
        with self._lock:
            if self.exit_code is not None:
                raise RequestError(Status.UNAVAILABLE, "the engine process has exited; the server is stopping",
                                   transient=True)  # fmt: skip
            self.admission(len(self._handles) - self._running)  # waiting as of the core's last step: never fewer
            when = time.perf_counter() if arrival is None else arrival
            h = Handle(next(self._keys), sink, req.api, when, req.request_id, len(req.prompt_ids))
            self._handles[h.key] = h  # a core that dies from here on fails it with the others (`_exited`)
            self._send(("submit", h.key, req, h.arrival))
        return h

    def cancel(self, h: Handle) -> None:
        if not h.done:
            self._send(("cancel", h.key))

    def end_all(self, code: Status, message: str) -> None:
        self._send(("end_all", code, message))

    def idle(self) -> bool:
        with self._lock:
            return not self._handles

    def warm_up(self) -> WarmUp:
        self._send(("warm_up",))
        kind, *args = self._replies.get()
        if kind != "warmed":
            raise WarmUpError(args[0])
        return args[0]

    def start(self) -> EngineProcess:
        self._send(("start",))
        return self

    def stop(self) -> None:
        """Stop the core and wait for it (again: nothing); only the pipe's thread reaps the process (two waiters
        race for its exit status)."""
        atexit.unregister(self.stop)
        self._stopping = True
        self._send(("stop",))
        self._reader.join(30)
        if self._reader.is_alive():
            log.error("the engine process did not stop within 30 s; killing it")
            self._process.kill()
            self._reader.join(10)

    def on_exit(self, callback: Callable[[], None]) -> None:
        """Call `callback` (from the pipe's thread) when the core's process ends without being told to stop."""
        self._on_exit.append(callback)

    # ---- the pipe ----------------------------------------------------------------------------------------------
    def _send(self, msg: tuple) -> None:
        with contextlib.suppress(OSError):  # a core that is gone: its end of the pipe reports it to every waiter
            self._pipe.send(msg)

    def _read(self) -> None:
        try:
            while True:
                kind, *args = self._pipe.recv()
                if kind == "step":
                    self._step(*args)
                else:
                    self._replies.put((kind, *args))
        except (EOFError, OSError):
            pass
        except Exception:  # a message this side cannot read: the core cannot be trusted to go on
            log.exception("unreadable message from the engine process; stopping it")
            self._process.kill()
        self._exited()

    def _step(self, st: StepStats, events: list[tuple[int, Event]], ended: list[int]) -> None:
        self.metrics.log_step(st)
        with self._lock:
            self._running = st.running
            sends = [(h.sink, ev) for k, ev in events if (h := self._handles.get(k)) is not None]
            for k in ended:
                h = self._handles.pop(k, None)
                if h is not None:
                    h.done = True
        self.delivery.send(sends)
        self.metrics.bin_due()

    def _exited(self) -> None:
        """The pipe closed: every unfinished request ends with INTERNAL (a crash) or UNAVAILABLE (a stop)."""
        self._process.join(10)
        code = self._process.exitcode
        with self._lock:
            self.exit_code = -1 if code is None else code
            handles, self._handles = list(self._handles.values()), {}
        if self._stopping:
            status, message = Status.UNAVAILABLE, "the server stopped before this request finished"
        else:
            log.error("the engine process exited with code %s; ending %d requests", code, len(handles))
            status = Status.INTERNAL
            message = f"the engine process exited (code {code}) before this request finished; see the server log"
        now = time.perf_counter()
        for h in handles:
            h.done = True
            outcome = RequestOutcome(status.value, h.api, now - h.arrival, h.request_id, h.prompt_tokens)
            self.metrics.log_outcome(outcome)
        self.delivery.send([(h.sink, Failed(status, message)) for h in handles])
        self._replies.put(("exited", f"the engine process exited (code {code})"))
        if not self._stopping:
            for callback in self._on_exit:
                callback()


def _rebuilt(kind: str, message: str) -> Exception:
    """The core's start-up error as this process raises it: a BackendError stays one (sharp-serve exits 2)."""
    from sharp.serving.backends.interface import BackendError

    return BackendError(message) if kind == "BackendError" else CoreExited(f"{kind}: {message}")
