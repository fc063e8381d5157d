"""A simulated vLLM pod: OpenAI endpoints, vLLM metrics, continuous batching, faults."""

from __future__ import annotations

from llmgw.sim.pod import SimPod
from llmgw.sim.types import Faults, SimSettings

__all__ = ["Faults", "SimPod", "SimSettings"]
