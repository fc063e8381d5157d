"""One real vLLM CPU pod for the benchmarks, started as the stack starts its pods.

The argv, environment and readiness probe are the stack's (tools/engine.py pod_argv and pod_env,
`http_ok` on /health, the pods' key in VLLM_API_KEY: `Stack._vllm_process`); the vLLM environment
and the model directory come from the stack's settings, so `LLMGW_STACK__VLLM__VENV` and
`LLMGW_STACK__VLLM__MODELS_DIR` point a benchmark at a shared copy.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from llmgw import config
from tools.engine import VllmSettings, ensure_model, pod_argv, pod_env
from tools.procs import Process, free_port, http_ok
from tools.stack import POD_KEY_ENV, StackSettings

# The API server's child that runs the engine loop (its comm, cut to 15 characters by Linux).
ENGINE_CORE_COMM = "VLLM::EngineCor"
PAGE = os.sysconf("SC_PAGE_SIZE")


def settings() -> VllmSettings:
    """The stack's vLLM settings with its environment overrides."""
    return config.load(StackSettings, None, "LLMGW_STACK").vllm


class Pod:
    """A real pod on a free port with a key of its own; `spawn` it, then `wait_ready`."""

    def __init__(self, vllm: VllmSettings, state_dir: Path, index: int = 0) -> None:
        self.port = free_port()
        self.key = secrets.token_hex(32)
        model = ensure_model(vllm)
        argv = pod_argv(vllm, model, "127.0.0.1", self.port)
        env = pod_env(vllm, index, {**os.environ, POD_KEY_ENV: self.key})
        ready = http_ok(f"{self.url}/health")
        self.process = Process(f"pod-{index}", argv, ready, state_dir / f"pod-{index}.log", env)
        self.timeout = vllm.start_timeout
        self.model = vllm.served_model_name

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        if self.process.pid is None:
            raise RuntimeError("the pod was not spawned")
        return self.process.pid

    def engine_core(self) -> int | None:
        return engine_core(self.pid)


def engine_core(api_server: int) -> int | None:
    """The EngineCore child's pid, once the API server has started it."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                head, _, rest = f.read().rpartition(b")")
        except OSError:
            continue
        comm = head.partition(b"(")[2].decode(errors="replace")
        if comm == ENGINE_CORE_COMM and int(rest.split()[1]) == api_server:
            return int(entry)
    return None


def rss_mib(pid: int) -> float:
    """Resident memory of one process (all its threads), MiB."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * PAGE / 2**20
