"""A simulated vLLM pod: OpenAI endpoints, vLLM metrics, continuous batching, faults."""

from __future__ import annotations

from sim.pod import SimPod
from sim.types import Faults, SimSettings

__all__ = ["Faults", "SimPod", "SimSettings"]
