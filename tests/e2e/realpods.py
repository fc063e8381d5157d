"""The real-vLLM tier's fixtures: the vLLM environment (or the reason the tier is skipped), a stack
of real pods (the CPU build serving the tiny model), and the pods' own counters.

At most two real pods per module, started once: each takes ~1-2 minutes on 2 cores. Every module
of the tier is marked `vllm` (`-m "not vllm"` leaves it out) and given a timeout that covers a
start on a busy machine.
"""

from __future__ import annotations

import os
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest

from llmgw.config import load
from tests.e2e.conftest import stack_settings
from tools.engine import STAMP, VllmSettings, ensure_venv
from tools.stack import Stack, StackSettings

VENV_ENV = "LLMGW_STACK__VLLM__VENV"
# A real pod took up to 8 minutes to start on a busy 2-core machine (imports dominate).
START_TIMEOUT = 900.0
MARKS = [pytest.mark.vllm, pytest.mark.timeout(1800)]


def vllm_settings_or_skip() -> VllmSettings:
    """The stack's vLLM settings (LLMGW_STACK__VLLM__* chooses the environment and the models'
    directory). An environment named in the environment is made if missing; the default one is
    only used if `make vllm` made it, else the tier is skipped, saying so."""
    settings = load(StackSettings, None, "LLMGW_STACK").vllm
    if VENV_ENV in os.environ:
        ensure_venv(settings)
    elif not (settings.venv / STAMP).exists():
        pytest.skip(f"no vLLM environment at {settings.venv}: run `make vllm`")
    return settings.model_copy(update={"start_timeout": START_TIMEOUT})


@contextmanager
def real_stack(
    state: Path, pods: int = 1, sim_pods: int = 0, vllm_args: tuple[str, ...] = ()
) -> Iterator[Stack]:
    """The whole stack in front of `pods` real pods (then `sim_pods` simulated ones), stopped
    however the module ends."""
    vllm = vllm_settings_or_skip()
    settings = stack_settings(pods=pods).model_copy(
        update={
            "engine": "vllm",
            "sim_pods": sim_pods,
            "vllm": vllm.model_copy(update={"args": (*vllm.args, *vllm_args)}),
        }
    )
    with Stack(StackSettings.model_validate(settings.model_dump()), state) as stack:
        yield stack


def pod_metrics(stack: Stack, index: int = 0) -> dict[str, float]:
    """Pod `index`'s `vllm:` samples, summed over label sets, by name."""
    with urllib.request.urlopen(f"{stack.pod_url(index)}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            sums[name] = sums.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return sums


def model(stack: Stack) -> str:
    """The model the stack's real pods serve."""
    assert stack.served_model is not None
    return stack.served_model


def sdk(stack: Stack, key: str) -> openai.OpenAI:
    """The OpenAI SDK as a tenant uses it, without its retries: each call is one request."""
    return openai.OpenAI(base_url=stack.base_url, api_key=key, max_retries=0, timeout=120)
