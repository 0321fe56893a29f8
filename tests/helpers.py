"""Helpers shared by test modules (a test module never imports another one)."""

from __future__ import annotations

from sharp.serving import Engine
from sharp.serving.requests import RequestParams, validate


def greedy_request(eng: Engine, ids, n, **kw):
    """A validated greedy request for an engine stepped by hand."""
    return validate(RequestParams(input_ids=list(ids), max_new_tokens=n, temperature=0.0, **kw), eng.limits,
                    eng.tokenizer.encode)  # fmt: skip


def run_until_idle(eng: Engine, steps: int = 2000) -> None:
    for _ in range(steps):
        if eng.idle():
            return
        eng.step()
    raise AssertionError(f"the engine is still busy after {steps} steps")
