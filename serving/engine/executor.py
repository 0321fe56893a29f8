"""The executor: a step's model calls on the backend — one batched prefill of the plan's chunks, one batched decode
step of the running sequences — timed into the step's statistics, and the sampling of their logits into tokens
(with the model's own log-probabilities, when asked). The backend owns the KV cache and the batching of what it is
given (serving/backends/interface.py)."""

from __future__ import annotations

import time

import numpy as np

from sharp.serving.backends.interface import Backend, Chunk, StepResult
from sharp.serving.engine.matcher import allowed_bits, prefetch
from sharp.serving.engine.output import TokenLogprob, as_token_logprobs
from sharp.serving.engine.scheduler import Sequence
from sharp.serving.grammar import GrammarError
from sharp.serving.stats import StepStats


class Executor:
    def __init__(self, backend: Backend, eos_ids: frozenset[int] = frozenset()):
        self.backend, self.eos_ids = backend, eos_ids

    def prefill(self, chunks: list[Chunk], entropy: bool, stats: StepStats) -> list[StepResult | None]:
        """One result per chunk; None where the model failed on that prompt (it ends alone)."""
        began = time.perf_counter()
        results = self.backend.prefill_many(chunks, entropy)
        stats.forward_seconds += time.perf_counter() - began
        return results

    def decode(self, seqs: list[Sequence], entropy: bool, stats: StepStats) -> StepResult:
        """One token for each of `seqs`, fed its newest token."""
        tokens = np.array([[s.generated[-1]] for s in seqs], np.int64)
        began = time.perf_counter()
        out = self.backend.decode(seqs, tokens, entropy)
        stats.forward_seconds += time.perf_counter() - began
        stats.decode_batch = len(seqs)
        if out.pages_skipped is not None:
            stats.pages_skipped.append(out.pages_skipped)
        return out

    def sample(self, seqs: list[Sequence], logits) -> tuple[list[int | None], list[TokenLogprob | None]]:
        """Each row's next token (None where its logits are unusable) and, for the rows whose request asked, its
        log-probability — computed in one batched pass over those rows only, from the model's own logits (before
        any request's processing, as vLLM reports them). The arrays are the backend's sampler's (backends/sampler.py:
        host NumPy, or the torch backend's device tensors, where only token ids and log-probabilities cross).

        A row with a grammar whose matcher is `checked` samples unmasked first; the grammar takes the token if it
        allows it, and only the rows it refuses are masked and sampled again (grammar.py `Matcher`: exact). Where
        the grammar is known to allow one token only (`Matcher.forced`), a greedy row takes it: the masked row's
        argmax. A sampling row draws as it would have: whether a state is known depends on the requests before,
        and its seed must give the same tokens whatever ran before it."""
        ops = self.backend.sampler
        params, generators = [s.request.sampling for s in seqs], [s.generator for s in seqs]
        processed = self._processed(seqs, logits)
        chosen = ops.sample_rows(processed, params, generators)
        refused = []
        for i, s in enumerate(seqs):
            if s.matcher is not None and s.matcher.checked:
                forced = s.matcher.forced() if s.request.sampling.greedy else None  # (a drawn row draws as ever)
                if chosen[i] is not None and forced is not None and forced not in self._banned(s):
                    chosen[i] = _taken(s, forced)  # the only token allowed: the masked row's argmax
                elif chosen[i] is None or not s.matcher.accepts(chosen[i]):
                    refused.append(i)
            elif s.matcher is not None and chosen[i] is not None:
                chosen[i] = _taken(s, chosen[i])
        if refused:  # masked, and drawn again from what the grammar allows
            again = ops.rows(processed, refused)
            bits = allowed_bits([seqs[i].matcher for i in refused], logits.shape[1])
            ops.mask(again, list(range(len(refused))), bits)
            drawn = ops.sample_rows(again, [params[i] for i in refused], [generators[i] for i in refused])
            for i, token in zip(refused, drawn, strict=True):
                chosen[i] = None if token is None else _taken(seqs[i], token)
        prefetch([s.matcher for s in seqs if s.matcher is not None and not s.matcher.checked])
        out: list[TokenLogprob | None] = [None] * len(seqs)
        rows = [i for i, s in enumerate(seqs) if s.request.logprobs is not None and chosen[i] is not None]
        if rows:
            top = [seqs[i].request.logprobs for i in rows]
            picked = [chosen[i] for i in rows]
            lp = ops.token_logprobs(logits, rows, picked, max(top))
            for i, made in zip(rows, as_token_logprobs(lp, picked, top), strict=True):
                out[i] = made
        return chosen, out

    def _processed(self, seqs: list[Sequence], logits):
        """The logits each row samples from: its request's logit bias and penalties over its history
        (models/sampling.py `process`); while it is short of its min_tokens, end-of-sequence and its
        stop_token_ids masked; with a grammar (structured outputs), every token it does not allow next masked (all
        such rows at once, last). Rows that need nothing cost nothing (no copy when none does)."""
        masked = lambda s: s.matcher is not None and not s.matcher.checked  # a checked one is masked when refused
        banned = {i: ids for i, s in enumerate(seqs) if (ids := self._banned(s))}
        rows = [i for i, s in enumerate(seqs) if s.request.sampling.processes or i in banned or masked(s)]
        if not rows:
            return logits
        ops = self.backend.sampler
        out = ops.copy(logits)
        for i in rows:
            seq, req = seqs[i], seqs[i].request
            if req.sampling.processes:
                ops.process(out, i, req.sampling, seq.prompt_array(), np.asarray(seq.generated, np.int64))
            if i in banned:
                ops.ban(out, i, banned[i])
        constrained = [i for i in rows if masked(seqs[i])]
        if constrained:  # last: whatever else changed, only what the grammar allows remains
            ops.mask(out, constrained, allowed_bits([seqs[i].matcher for i in constrained], logits.shape[1]))
        return out

    def _banned(self, seq: Sequence) -> list[int]:
        """The tokens `seq` may not sample this step: end-of-sequence and its stop_token_ids, while it is short of
        its min_tokens."""
        req = seq.request
        if len(seq.generated) >= req.min_tokens:
            return []
        return [*req.stop_token_ids, *(() if req.ignore_eos else self.eos_ids)]


def _taken(seq: Sequence, token: int) -> int | None:
    """`token`, taken by the sequence's grammar; None if the grammar refuses it (its row ends alone, as an unusable
    one does)."""
    try:
        seq.matcher.take(token)
    except GrammarError:
        return None
    return token
