"""A stand-in for the parts of `tensorrt` / `tensorrt.plugin` that `register` touches, for where TensorRT cannot be
installed (this project's machines, the lent GPUs' image): decorators that record what would be registered, shape
expressions that evaluate against concrete shapes, and the launch-parameter record. Not TensorRT: it cannot tell
whether TensorRT would accept any of it."""

from __future__ import annotations

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


@dataclass
class Registry:
    """What `register` registered, by (kind, plugin name): kind is register, autotune or aot_impl."""

    registered: dict = field(default_factory=dict)

    def _decorator(self, kind: str):
        def named(name: str):
            def deco(fn):
                self.registered[(kind, name)] = fn
                return fn

            return deco

        return named

    def trtp(self) -> SimpleNamespace:
        """The `tensorrt.plugin` surface `register` uses."""
        return SimpleNamespace(
            register=self._decorator("register"),
            autotune=self._decorator("autotune"),
            aot_impl=self._decorator("aot_impl"),
            TensorDesc=TensorDesc,
            KernelLaunchParams=LaunchParams,
            SymExprs=tuple,
            AutoTuneCombination=lambda spec: ("combination", spec),
            from_shape_expr=lambda shape, dtype: TensorDesc(dtype, tuple(shape)),
            cdiv=lambda a, b: (Sym.of(a) + (b - 1)) // b,
            SymInt32=Sym.of,
            SymIntExprs=SimpleNamespace(from_tuple=tuple),
        )


# The `tensorrt` module surface: data types compared by identity.
TRT = SimpleNamespace(float16="float16", bfloat16="bfloat16", float32="float32", int32="int32")
