"""The tenant breaker's rule (llmgw/breaker.lua) restated as a pure model on a given clock: the
oracle the Lua scripts are checked against (tests/ratelimit/test_rl_breaker.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from llmgw.breaker import BreakerSpec


@dataclass
class Model:
    spec: BreakerSpec
    score: float = 0.0  # failures
    mistakes: float = 0.0
    scored_at: int | None = None
    until: int | None = None  # while tripped: the cool-down's end (ms)
    cooldown: int = 0
    first: int = 0
    step_ms: int = 0
    shares: tuple[int, ...] = ()
    seen: int = 0  # requests seen in half-open step `seen_in`
    seen_in: tuple[int, int] | None = None

    def phase(self, now: int) -> tuple[str, int, int, int]:
        """(phase, step, share per mille, the end of the cool-down / step / recovery)."""
        if self.until is None:
            return "closed", 0, 0, 0
        if now < self.until:
            return "open", 0, 0, self.until
        k = (now - self.until) // self.step_ms + 1
        if k > len(self.shares):
            return "recovered", 0, 0, self.until + len(self.shares) * self.step_ms
        return "half", k, self.shares[k - 1], self.until + k * self.step_ms

    def admit(self, now: int) -> int | None:
        """None: admitted; else the wait (ms) the refusal suggests."""
        phase, k, share, ends = self.phase(now)
        if phase == "open":
            return ends - now
        if phase != "half":
            return None
        assert self.until is not None
        step = (self.until, k)
        c = self.seen if self.seen_in == step else 0
        self.seen, self.seen_in = c + 1, step
        return None if (c * share) // 1000 != ((c - 1) * share) // 1000 else ends - now

    def feed(self, now: int, weights: list[tuple[float, str, str]]) -> list[str]:
        """`weights`: (weight, score "s" or "m", cause) per outcome."""
        """The transitions, in breaker.lua's words."""
        s = self.spec
        events = []
        phase, _, _, ends = self.phase(now)
        if phase == "recovered":
            events.append(f"recover {ends} {self.first}")
            self.until, self.seen_in = None, None
            phase = "closed"
        for w, score, cause in weights:
            if w <= 0 or phase == "open":
                continue
            at = now if self.scored_at is None else self.scored_at
            decay = math.exp(-s.decay_per_min / 60_000 * (now - at))
            self.score, self.mistakes = self.score * decay, self.mistakes * decay
            self.scored_at = now
            if score == "m":
                self.mistakes += w
                tripped = self.mistakes >= s.mistakes_threshold - s.slack
            else:
                self.score += w
                limit = s.recovery_threshold if phase == "half" else s.threshold
                tripped = self.score >= limit - s.slack
            if tripped:
                reopen = phase == "half"
                base, longest = int(s.cooldown_s * 1000), int(s.cooldown_max_s * 1000)
                self.cooldown = (
                    min(int(self.cooldown * s.cooldown_growth), longest) if reopen else base
                )
                if not reopen:
                    self.first = now
                self.score, self.mistakes, self.until = 0.0, 0.0, now + self.cooldown
                self.step_ms = int(s.step_s * 1000)
                self.shares = tuple(round(x * 1000) for x in s.steps)
                events.append(f"trip {now} {cause} {self.cooldown} {int(reopen)} {self.first}")
                phase = "open"
        return events
