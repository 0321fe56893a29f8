"""Generated text with stop strings, linear in its length (the tokenizer's stream turns tokens into text).

Each stop string has a KMP automaton whose state is the longest prefix of the stop string that ends the text so
far: one character costs O(1) amortised per stop string, a match is the state reaching the full length, and the
text that must be held back (it could still become a stop string) is the largest state.
"""

from __future__ import annotations


def _prefix_function(s: str) -> list[int]:
    """fail[i]: the length of the longest proper prefix of s[: i + 1] that is also its suffix."""
    fail = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail


class _StopMatcher:
    def __init__(self, stop: str):
        self.stop, self.fail, self.state = stop, _prefix_function(stop), 0

    def feed(self, c: str) -> bool:
        """Advance by one character; True when the stop string has just been completed."""
        s = self.state
        while s and self.stop[s] != c:
            s = self.fail[s - 1]
        if self.stop[s] == c:
            s += 1
        if s == len(self.stop):
            self.state = self.fail[s - 1]
            return True
        self.state = s
        return False


class StopText:
    """Text as tokens arrive; generation stops at the first completed stop string (the text ends before it, or
    after it with `keep`), and text that could still become one is held back."""

    def __init__(self, stops: tuple[str, ...], keep: bool = False):
        self.matchers = [_StopMatcher(s) for s in stops if s]
        self.keep = keep
        self.text, self.emitted, self.stopped = "", 0, False

    def push(self, new: str, armed: bool = True) -> str:
        """Add one token's text; returns the text that is now safe to send. Unarmed (a request short of its
        min_tokens), a completed stop string does not stop it."""
        if self.stopped:
            return ""
        if not self.matchers:
            self.text += new
            return self._release(len(self.text))
        for i, c in enumerate(new):
            for m in self.matchers:
                if m.feed(c) and armed:
                    cut = 0 if self.keep else len(m.stop)
                    self.text = (self.text + new[: i + 1])[: len(self.text) + i + 1 - cut]
                    self.stopped = True
                    return self._release(len(self.text))
        self.text += new
        return self._release(len(self.text) - max(m.state for m in self.matchers))

    def finish(self, rest: str = "") -> str:
        """The held-back text at the end (`rest`: what the detokenizer still held), stop strings still applied."""
        out = self.push(rest) if rest else ""
        return out + self._release(len(self.text))

    def _release(self, upto: int) -> str:
        out = self.text[self.emitted : upto] if upto > self.emitted else ""
        self.emitted = max(self.emitted, upto)
        return out
