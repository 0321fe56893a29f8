"""A stand-in for the parts of `tensorrt` / `tensorrt.plugin` that `register` touches, for where TensorRT cannot be
installed (this project's machines, the lent GPUs' image): decorators that record what would be registered and
check the function signatures as TensorRT's plugin module documents it does (annotated tensor arguments first,
then attributes, `outputs`/`tactic` last, attribute types repeated consistently, the return annotations), shape
expressions that evaluate against concrete shapes, and the launch-parameter record. Not TensorRT: it cannot tell
whether TensorRT would accept everything.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace


@dataclass
class Sym:
    """A shape expression: a function of the runtime binding {name: int}, constant when its value is known."""

    fn: Callable[[dict], int]
    const: int | None = None

    @staticmethod
    def of(x) -> Sym:
        return x if isinstance(x, Sym) else Sym(lambda env, x=x: x, int(x))

    @staticmethod
    def named(name: str) -> Sym:
        return Sym(lambda env: env[name])

    @property
    def is_constant(self) -> bool:
        return self.const is not None

    def constant_value(self) -> int:
        return self.const

    def __call__(self, env: dict | None = None) -> int:
        return self.fn(env or {})

    def _op(self, other, f) -> Sym:
        a, b = self, Sym.of(other)
        const = f(a.const, b.const) if a.is_constant and b.is_constant else None
        return Sym(lambda env: f(a(env), b(env)), const)

    def __add__(self, o) -> Sym:
        return self._op(o, lambda x, y: x + y)

    def __mul__(self, o) -> Sym:
        return self._op(o, lambda x, y: x * y)

    def __floordiv__(self, o) -> Sym:
        return self._op(o, lambda x, y: x // y)

    __rmul__ = __mul__


@dataclass
class TensorDesc:
    dtype: str
    shape_expr: tuple

    @classmethod
    def of_shape(cls, dtype: str, shape) -> TensorDesc:
        """Every dim known (a static shape)."""
        return cls(dtype, tuple(Sym.of(s) for s in shape))

    def like(self) -> TensorDesc:
        return TensorDesc(self.dtype, self.shape_expr)


@dataclass
class LaunchParams:
    grid_x: object = 1
    grid_y: object = 1
    grid_z: object = 1
    block_x: int = 1
    shared_mem: int = 0


class SymExprs(tuple):
    """Extra kernel arguments (the real one is a sequence of SymInt32)."""

    @classmethod
    def from_tuple(cls, items) -> SymExprs:
        return cls(items)


@dataclass(frozen=True)
class AutoTuneCombination:
    spec: str


def _is_text(annotation) -> bool:
    """str, bytes, or a union of them (a kernel name or its PTX)."""
    union = set(typing.get_args(annotation))
    return annotation in (str, bytes) or (bool(union) and union <= {str, bytes})


class SignatureError(ValueError):
    """A decorated function TensorRT's plugin module would refuse."""


def _is_tuple_of(annotation, cls) -> bool:
    args = typing.get_args(annotation)
    return typing.get_origin(annotation) is tuple and bool(args) and all(issubclass(a, cls) for a in args)


@dataclass
class Registry:
    """What `register` registered, by (kind, plugin name): kind is register, autotune or aot_impl."""

    registered: dict = field(default_factory=dict)
    tensors: dict = field(default_factory=dict)  # plugin name → tensor argument names
    attributes: dict = field(default_factory=dict)  # plugin name → {attribute: annotation}, in order

    def _register(self, name: str):
        def deco(fn):
            tensors, attrs = [], {}
            for arg, p in inspect.signature(fn).parameters.items():
                if p.annotation is inspect.Parameter.empty:
                    raise SignatureError(f"register: argument {arg} has no type annotation")
                if inspect.isclass(p.annotation) and issubclass(p.annotation, TensorDesc):
                    if attrs:
                        raise SignatureError("register: tensor arguments must all come before the attributes")
                    tensors.append(arg)
                elif arg in ("outputs", "stream", "tactic"):
                    raise SignatureError(f"register: {arg} cannot be an attribute name")
                else:
                    attrs[arg] = p.annotation
            ret = inspect.signature(fn).return_annotation
            if not (_is_tuple_of(ret, TensorDesc) or (inspect.isclass(ret) and issubclass(ret, TensorDesc))):
                raise SignatureError(f"register: returns {ret}, not TensorDesc or tuple[TensorDesc, ...]")
            self.registered[("register", name)], self.tensors[name], self.attributes[name] = fn, tensors, attrs
            return fn

        return deco

    def _check_schema(self, kind: str, name: str, fn, tail: tuple[str, ...]) -> inspect.Signature:
        sig = inspect.signature(fn)
        attrs = self.attributes[name]
        used = [a for a in attrs if a in sig.parameters]
        expected = [*self.tensors[name], *used, *tail]
        if list(sig.parameters) != expected:
            raise SignatureError(f"{kind}: arguments {list(sig.parameters)}, expected {expected}")
        for a in used:
            annotation = sig.parameters[a].annotation
            if annotation is not inspect.Parameter.empty and annotation != attrs[a]:
                raise SignatureError(f"{kind}: attribute {a} annotated {annotation}, registered {attrs[a]}")
        outputs = sig.parameters["outputs"].annotation
        if outputs is not inspect.Parameter.empty and not _is_tuple_of(outputs, TensorDesc):
            raise SignatureError(f"{kind}: outputs annotated {outputs}, not tuple[TensorDesc, ...]")
        return sig

    def _autotune(self, name: str):
        def deco(fn):
            ret = self._check_schema("autotune", name, fn, ("outputs",)).return_annotation
            listed = typing.get_origin(ret) is list and all(
                issubclass(a, AutoTuneCombination) for a in typing.get_args(ret)
            )
            if ret is not inspect.Parameter.empty and not listed and ret is not AutoTuneCombination:
                raise SignatureError(f"autotune: returns {ret}, not list[AutoTuneCombination]")
            self.registered[("autotune", name)] = fn
            return fn

        return deco

    def _aot_impl(self, name: str):
        def deco(fn):
            ret = self._check_schema("aot_impl", name, fn, ("outputs", "tactic")).return_annotation
            args = typing.get_args(ret)
            ok = typing.get_origin(ret) is tuple and len(args) == 4 and _is_text(args[0]) and _is_text(args[1])
            if not (ok and issubclass(args[2], LaunchParams) and issubclass(args[3], SymExprs)):
                raise SignatureError(f"aot_impl: returns {ret}, not tuple[bytes, bytes, KernelLaunchParams, SymExprs]")
            self.registered[("aot_impl", name)] = fn
            return fn

        return deco

    def trtp(self) -> SimpleNamespace:
        """The `tensorrt.plugin` surface `register` uses."""
        return SimpleNamespace(
            register=self._register,
            autotune=self._autotune,
            aot_impl=self._aot_impl,
            TensorDesc=TensorDesc,
            KernelLaunchParams=LaunchParams,
            SymExprs=SymExprs,
            SymIntExprs=SymExprs,
            AutoTuneCombination=AutoTuneCombination,
            from_shape_expr=lambda shape, dtype: TensorDesc(dtype, tuple(shape)),
            cdiv=lambda a, b: (Sym.of(a) + (b - 1)) // b,
            SymInt32=Sym.of,
        )


# The `tensorrt` module surface: data types compared by identity.
TRT = SimpleNamespace(float16="float16", bfloat16="bfloat16", float32="float32", int32="int32")
