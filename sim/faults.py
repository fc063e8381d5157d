"""Runtime fault injection: the switches and the seeded dice that apply them."""

from __future__ import annotations

import random
from typing import Any

from llmgw.config import ConfigError, validate
from sim.types import Faults

CLOSE_AFTER_CHUNKS = 3  # a dropped stream still delivers its first few chunks


class FaultState:
    def __init__(self, seed: int) -> None:
        self.current = Faults()
        self._dice = random.Random(seed)

    def update(self, fields: Any) -> Faults:
        """Merge fields into the current faults; ValueError names a bad one."""
        if not isinstance(fields, dict):
            raise ValueError("faults must be a JSON object")
        try:
            self.current = validate(Faults, self.current.model_dump() | fields, "faults")
        except ConfigError as exc:
            raise ValueError(str(exc)) from exc
        return self.current

    def clear(self) -> Faults:
        self.current = Faults()
        return self.current

    def error(self, tenant: str) -> bool:
        """Whether this request fails (`tenant`: whose it is, "" when no gateway said)."""
        only = self.current.error_tenants
        return (not only or tenant in only) and self._roll(self.current.error_rate)

    def close(self) -> bool:
        return self._roll(self.current.close_mid_stream)

    def fail_mid_stream(self) -> bool:
        return self._roll(self.current.error_mid_stream)

    def _roll(self, probability: float) -> bool:
        return probability >= 1.0 or (probability > 0.0 and self._dice.random() < probability)
