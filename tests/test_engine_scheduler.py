"""The scheduler alone: queues, admission and step plans, with no backend and no model (serving/engine/scheduler.py)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from sharp.serving.engine.scheduler import Scheduler, Sequence
from sharp.serving.requests import GenerationRequest


def _seq(prompt: int, new: int = 4, name: str = "r") -> Sequence:
    req = GenerationRequest(tuple(range(1, prompt + 1)), new, None, 0, (), False, name)  # sampling unused here
    return Sequence(req, np.random.default_rng(0))


class Budget:
    """A KV budget in tokens, as a backend's reserve() keeps one."""

    def __init__(self, tokens: int):
        self.free, self.asked = tokens, []

    def reserve(self, seq: Sequence) -> int | None:
        self.asked.append(seq.request.request_id)
        if seq.reserved > self.free:
            return None
        self.free -= seq.reserved
        return 0


def test_admission_is_in_order_within_the_batch_and_the_kv_budget():
    s = Scheduler(max_batch=3, prefill_chunk=100)
    seqs = [_seq(10, 6, "a"), _seq(50, 50, "b"), _seq(2, 2, "c"), _seq(2, 2, "d"), _seq(1, 1, "e")]
    s.waiting.extend(seqs)
    budget = Budget(40)
    a, b, c, d, e = seqs
    assert s.admit(budget.reserve) == [a, c, d]  # b needs 100 tokens of 24 left: c and d, behind it, fit
    assert budget.asked == ["a", "b", "c", "d"] and list(s.waiting) == [b, e] and b.overtaken == 2
    budget.free += 100
    assert s.admit(budget.reserve) == []  # the batch holds 3
    s.prefilling.remove(a)
    assert s.admit(budget.reserve) == [b] and s.prefilling == [c, d, b] and list(s.waiting) == [e] and s.busy()


def test_a_request_that_does_not_fit_is_overtaken_a_bounded_number_of_times():
    """No head-of-line blocking, and no starvation: small requests pass a large one until it has been passed
    max_overtakes times; then nothing passes it until it fits."""
    s = Scheduler(max_batch=8, prefill_chunk=100, max_overtakes=2)
    big, smalls = _seq(50, 50, "big"), [_seq(2, 2, f"s{i}") for i in range(4)]
    for q in (big, *smalls):
        s.add(q)
    budget = Budget(8)
    assert s.admit(budget.reserve) == smalls[:2] and big.overtaken == 2  # 4 tokens each: the budget holds two
    budget.free += 100
    assert s.admit(lambda q: None if q is big else 0) == []  # big has waited enough: s2 and s3 wait behind it
    assert budget.reserve(big) == 0 and s.admit(lambda q: 0) == [big, *smalls[2:]]


def test_the_queue_is_ordered_by_priority_then_arrival():
    s = Scheduler(max_batch=8, prefill_chunk=100)
    made = {}
    for name, priority in [("a", 0), ("b", 5), ("c", -1), ("d", 0), ("e", 5), ("f", -1)]:
        made[name] = q = _seq(2, name=name)
        q.request = replace(q.request, priority=priority)
        s.add(q)
    assert [q.request.request_id for q in s.waiting] == list("cfadbe")
    assert [q.request.request_id for q in s.admit(lambda q: 0)] == list("cfadbe")


def test_aging_lets_a_waiting_request_past_a_flood_of_better_priorities():
    """A flood of priority -5 requests, one arriving every second, and a priority-0 request queued at t=0: with
    strict priority it waits for the whole flood; with aging (1 s per step of priority) it goes before every
    request that arrived 5 s or more after it, and before its own kind it keeps arrival order."""
    for aging, admitted_by in ((0.0, None), (1.0, 7)):
        now = [0.0]
        s = Scheduler(max_batch=1, prefill_chunk=100, aging=aging, clock=lambda now=now: now[0])
        low = _seq(2, name="low")
        s.add(low)
        order = []
        for t in range(1, 12):
            now[0] = float(t)
            flood = _seq(2, name=f"f{t}")
            flood.request = replace(flood.request, priority=-5)
            s.add(flood)
            (admitted,) = s.admit(lambda q: 0)  # one a step: a batch of one, freed at once
            s.prefilling.clear()
            order.append(admitted.request.request_id)
        if admitted_by is None:
            assert "low" not in order  # starved while better priorities keep coming
        else:
            assert order.index("low") < admitted_by  # past the flood's newer requests
            assert order[: order.index("low")] == [f"f{t}" for t in range(1, order.index("low") + 1)]


def test_a_plan_prefills_the_oldest_prompts_first_within_the_chunk_budget():
    s = Scheduler(max_batch=8, prefill_chunk=10)
    a, b, c = _seq(7, name="a"), _seq(6, name="b"), _seq(3, name="c")
    s.waiting.extend([a, b, c])
    s.admit(lambda seq: 0)
    plan = s.plan()
    assert [(ch.seq, ch.start, ch.ids.tolist()) for ch in plan.prefill] == [(a, 0, [[1, 2, 3, 4, 5, 6, 7]]),
                                                                           (b, 0, [[1, 2, 3]])]  # fmt: skip
    b.length = 3  # what the engine records once the chunk ran
    s.prefilled(a)
    plan = s.plan()
    assert [(ch.seq, ch.start, ch.ids.shape[1]) for ch in plan.prefill] == [(b, 3, 3), (c, 0, 3)]
    assert s.running == [a] and s.prefilling == [b, c]


def test_cancelled_and_ended_sequences_leave_every_queue():
    s = Scheduler(max_batch=2, prefill_chunk=10)
    a, b, c, d = (_seq(2, name=n) for n in "abcd")
    s.waiting.extend([a, b, c])
    s.admit(lambda seq: 0)
    s.prefilled(a)
    assert s.running == [a] and s.prefilling == [b] and list(s.waiting) == [c]
    s.waiting.append(d)
    b.cancelled = c.cancelled = True
    assert s.drop_cancelled() == [c, b] and b.done and c.done  # waiting first, then prefilling, then running
    assert s.prefilling == [] and list(s.waiting) == [d] and s.drop_cancelled() == []
    a.done = True
    s.leave([a])
    assert s.running == [] and s.unfinished() == [d]
    ended = _seq(2, name="e")
    s.waiting.append(ended)
    s.admit(lambda seq: 0)
    ended.done = True  # its prefill failed: it leaves prefilling without joining the decode batch
    s.prefilled(ended)
    assert s.running == [] and s.clear() == [d] and not s.busy()
    running = _seq(2, name="r")  # a stream cancelled mid-decode leaves the batch too
    s.waiting.append(running)
    s.admit(lambda seq: 0)
    s.prefilled(running)
    running.cancelled = True
    assert s.running == [running] and s.drop_cancelled() == [running] and s.running == [] and not s.busy()


def test_a_cached_prefix_is_not_planned_again():
    """Admission learns how many prompt tokens the prefix cache holds; the plan starts after them."""
    s = Scheduler(max_batch=8, prefill_chunk=100)
    a, b = _seq(40, name="a"), _seq(40, name="b")
    s.waiting.extend([a, b])
    assert s.admit(lambda seq: 32 if seq is a else 0) == [a, b]
    assert (a.length, b.length) == (32, 0)
    plan = s.plan()
    assert [(ch.seq, ch.start, ch.ids[0, 0], ch.ids.shape[1]) for ch in plan.prefill] == [(a, 32, 33, 8), (b, 0, 1, 40)]


def test_update_appends_the_sampled_tokens_and_says_which_requests_they_end():
    """The scheduler advances its sequences from a step's tokens: eos and the length limit end them there; an
    unusable row (None) ends failed, its cache not kept; a stop string is the output processor's, told by `end`."""
    s = Scheduler(max_batch=8, prefill_chunk=100, eos_ids={0})
    a, b, c, d = _seq(3, new=2, name="a"), _seq(3, new=5, name="b"), _seq(3, new=5, name="c"), _seq(3, name="d")
    s.waiting.extend([a, b, c, d])
    s.admit(lambda seq: 0)
    for q in (a, b, c, d):
        assert s.prompt_advanced(q, 2) is False and s.prompt_advanced(q, 1) is True
        s.prefilled(q)
    assert s.update([a, b, c, d], [7, 0, None, 9]) == [None, "eos", "error", None]
    assert (a.generated, b.generated, c.generated, d.generated) == ([7], [0], [], [9])
    assert [q.done for q in (a, b, c, d)] == [False, True, True, False] and c.failed and not b.failed
    assert s.update([a, d], [8, 9]) == ["length", None] and a.done and a.kept().tokens.tolist() == [1, 2, 3, 7]
    s.end(d)  # a stop string
    assert d.done and not d.failed
    s.leave([a, b, c, d])
    assert s.running == [] and not s.busy()


def test_update_honours_ignore_eos_stop_token_ids_and_min_tokens():
    """ignore_eos goes on past EOS; a stop token ends a request as "stop"; before min_tokens neither ends it (the
    executor's mask keeps them from being sampled; the scheduler does not rely on it)."""
    s = Scheduler(max_batch=8, prefill_chunk=100, eos_ids={0})
    on, stops, early = _seq(3, new=9, name="on"), _seq(3, new=9, name="stops"), _seq(3, new=9, name="early")
    on.request = replace(on.request, ignore_eos=True)
    stops.request = replace(stops.request, stop_token_ids=(5,))
    early.request = replace(early.request, stop_token_ids=(5,), min_tokens=2)
    assert s.update([on, stops, early], [0, 5, 5]) == [None, "stop", None]
    assert s.update([on, early], [0, 0]) == [None, None]  # early's second token: still within min_tokens
    assert s.update([on, early], [5, 5]) == [None, "stop"] and early.generated == [5, 0, 5]
