"""What a compiled kernel's key loops cost, read from its SASS — no GPU needed.

A kernel is compiled for sm_90 with the JIT's specialisations of one problem class (plugins/triton/aot.py), the cubin
is disassembled with the `nvdisasm` that ships with Triton (with inline line information), and every innermost loop
(a backward branch) that multiplies tiles on the tensor cores — or, in a kernel without a dot, loads tiles — is a
*key loop*. Per key loop: the static instruction count of its body per warp, by class, and that count per score
element, `instructions × 32 × warps / (rows × keys of a tile)`: one thread-instruction per element is one
instruction per element on every lane. The count is static: a branch inside the body (entmax's skipped tiles) counts
both paths. Which source call a loop comes from is read from the line information of its branch (the chain of
inlined calls): a loop whose chain passes a line with `MASKED=True` walks the edge tiles (the causal diagonal and
the last, partial tile), which a long row visits a bounded number of times, and is reported but not summed.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

# Opcode (before the first dot) → class. Everything else is "other" (moves, uniform-datapath setup, branches).
CLASSES: dict[str, tuple[str, ...]] = {
    "tensor": ("HGMMA", "HMMA", "WARPGROUP"),
    "mufu": ("MUFU",),
    "fp32": ("FADD", "FMUL", "FFMA", "FMNMX", "FSETP", "FSEL", "FCHK", "FSWZADD", "F2FP", "FRND", "F2F", "FMNMX3"),
    "int": ("IMAD", "IADD3", "LEA", "ISETP", "LOP3", "SHF", "SEL", "VIADD", "VIMNMX", "VIADDMNMX", "IMNMX", "SGXT",
            "IABS", "I2FP", "F2I", "I2F", "PRMT", "IADD", "BMSK", "POPC", "FLO", "LOP", "ISCADD"),
    "memory": ("LDG", "LDGSTS", "LDS", "STS", "STG", "LDSM", "STSM", "LDL", "STL", "LD", "ST", "UTMALDG", "LDC",
               "UBLKCP", "REDUX", "RED", "ATOM", "ATOMG"),
    "shuffle": ("SHFL",),
    "barrier": ("BAR", "WARPSYNC", "DEPBAR", "MEMBAR", "FENCE", "LDGDEPBAR", "ARRIVES", "SYNCS", "BSYNC", "BSSY"),
}  # fmt: skip
_CLASS_OF = {op: cls for cls, ops in CLASSES.items() for op in ops}
COLUMNS = (*CLASSES, "other")

_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P[0-9T]+\s+)?([A-Z][A-Z0-9_]*)([.A-Z0-9_]*)\s*(.*?);")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_BRANCH = re.compile(r"`\((\.L_x_\d+)\)")
_HGMMA = re.compile(r"HGMMA\.64x(\d+)x16")
_LINE = re.compile(r'^\s*//## File "([^"]+)", line (\d+)(?: inlined at "([^"]+)", line (\d+))?')


@dataclass
class Instr:
    address: int
    opcode: str  # without modifiers: HGMMA, MUFU, FFMA, …
    text: str
    lines: tuple[tuple[str, int], ...]  # the chain of (file, line), innermost first

    @property
    def cls(self) -> str:
        return _CLASS_OF.get(self.opcode, "other")


def parse(sass: str) -> tuple[list[Instr], dict[str, int]]:
    """Instructions (with the inline chain of source lines that `nvdisasm -gi` prints before them) and labels."""
    instrs: list[Instr] = []
    labels: dict[str, int] = {}
    chain: list[tuple[str, int]] = []
    pending_label: list[str] = []
    fresh = True  # a new block of line comments starts a new chain
    for line in sass.splitlines():
        if m := _LINE.match(line):
            if fresh:
                chain = []
                fresh = False
            if not chain:
                chain.append((m.group(1), int(m.group(2))))
            if m.group(3):
                chain.append((m.group(3), int(m.group(4))))
            continue
        if m := _LABEL.match(line):
            pending_label.append(m.group(1))
            continue
        if m := _INSTR.match(line):
            fresh = True
            address = int(m.group(1), 16)
            for label in pending_label:
                labels[label] = address
            pending_label = []
            instrs.append(Instr(address, m.group(3), line.strip(), tuple(chain)))
    return instrs, labels


@dataclass
class Loop:
    """One loop: the instructions from its head to its backward branch."""

    body: list[Instr]
    branch: Instr
    inner: list[Loop] = field(default_factory=list)
    outer: Loop | None = None

    @property
    def start(self) -> int:
        return self.body[0].address

    @property
    def end(self) -> int:
        return self.branch.address

    def counts(self) -> Counter:
        return Counter(i.cls for i in self.body)

    def has(self, *opcodes: str) -> bool:
        return any(i.opcode in opcodes for i in self.body)

    def spills(self) -> int:
        return sum(i.opcode in ("LDL", "STL") for i in self.body)

    def hgmma_keys(self, head_dim: int) -> int | None:
        """Keys per iteration of a loop that forms Q·Kᵀ with warpgroup MMAs: the N of the HGMMA shape (64 rows × N
        keys × 16) issued head_dim / 16 times or more (Q·Kᵀ's count; P·V issues keys / 16 of 64 × head_dim, the
        same shape only when keys = head_dim); None for a loop without that product."""
        shapes = Counter(m.group(1) for i in self.body if i.opcode == "HGMMA" and (m := _HGMMA.search(i.text)))
        qk = [int(n) for n, count in shapes.items() if count >= head_dim // 16]
        return max(qk) if qk else None

    def loaded_bytes(self) -> int:
        """Bytes one thread loads from global memory per iteration: each LDG's or LDGSTS's (an asynchronous copy
        into shared memory: the pipelined tile loads) width (.128, .64, .U16/.S16, .U8/.S8; 4 bytes otherwise)."""
        return sum(_LDG_BYTES.get(m.group(1), 4) if (m := _LDG_WIDTH.search(i.text)) else 4
                   for i in self.body if i.opcode in ("LDG", "LDGSTS"))  # fmt: skip


_LDG_WIDTH = re.compile(r"LDG(?:STS)?(?:\.E)?(?:\.EL)?(?:\.[A-Z_]+)*?\.(128|64|U16|S16|U8|S8)\b")
_LDG_BYTES = {"128": 16, "64": 8, "U16": 2, "S16": 2, "U8": 1, "S8": 1}


def loops(instrs: list[Instr], labels: dict[str, int]) -> list[Loop]:
    """Every loop, in program order, with its nesting. A loop is a label that branches jump back to; several back
    branches to one head (an `if` inside the body that ends the iteration early) are one loop, up to the last."""
    index = {i.address: n for n, i in enumerate(instrs)}
    last_back: dict[int, int] = {}  # head address → index of the last branch back to it
    for n, ins in enumerate(instrs):
        if ins.opcode != "BRA" or not (m := _BRANCH.search(ins.text)):
            continue
        target = labels.get(m.group(1))
        if target is not None and target <= ins.address:
            last_back[target] = n
    found = [Loop(instrs[index[head] : n + 1], instrs[n]) for head, n in sorted(last_back.items())]
    for lp in found:
        parents = [o for o in found if o is not lp and o.start <= lp.start and lp.end <= o.end]
        if parents:
            lp.outer = min(parents, key=lambda o: o.end - o.start)
            lp.outer.inner.append(lp)
    return found


def key_loops(all_loops: list[Loop]) -> list[Loop]:
    """Innermost loops that do the key tiles' work: with a tensor-core op or, where the kernel has none, a load."""
    innermost = [lp for lp in all_loops if not lp.inner]
    dots = [lp for lp in innermost if lp.has(*CLASSES["tensor"])]
    if dots:
        return dots
    return [lp for lp in innermost if lp.has("LDG", "LDGSTS")]


def call_chain(lp: Loop, sources: dict[str, str]) -> list[tuple[str, int]]:
    """(path, line) of the branch's inline chain that lie in `sources` (file name → path: the kernels' modules),
    innermost call first. A file is matched by name, since Triton's compile cache (keyed by the source text, not its
    path) may hand back a kernel compiled from another checkout of the same file."""
    return [(sources[name], line) for f, line in lp.branch.lines if (name := Path(f).name) in sources]


def body_lines(lp: Loop, sources: dict[str, str]) -> set[tuple[str, int]]:
    """(path, line) of the body's own instructions (innermost line each) that lie in `sources`."""
    return {(sources[name], line) for i in lp.body for f, line in i.lines[:1] if (name := Path(f).name) in sources}


def disassemble(cubin: bytes, nvdisasm: Path) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        proc = subprocess.run([str(nvdisasm), "-gi", "-c", str(path)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"nvdisasm failed: {proc.stderr.strip()[:300]}")
    return proc.stdout


def resource_usage(cubin: bytes, cuobjdump: Path) -> dict[str, int]:
    """REG, STACK, SHARED and LOCAL of the kernel, from `cuobjdump -res-usage`."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        out = subprocess.run([str(cuobjdump), "-res-usage", str(path)], capture_output=True, text=True, check=True)
    return {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", out.stdout)}
