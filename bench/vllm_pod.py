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

# The API server starts the EngineCore (the scheduler), which starts the Worker (the model runner,
# which busy-polls its shared-memory queue for 1 s after every step); names as in their comm.
PROCESSES = {"EngineCore": "VLLM::EngineCor", "Worker": "VLLM::Worker"}
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

    def processes(self) -> dict[str, int]:
        """The pod's processes by role: the API server, and those of its EngineCore and Worker
        that have started."""
        return processes(self.pid)


def _stat(pid: str) -> tuple[str, int]:
    """(comm, ppid) of a process."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        head, _, rest = f.read().rpartition(b")")
    return head.partition(b"(")[2].decode(errors="replace"), int(rest.split()[1])


def processes(api_server: int) -> dict[str, int]:
    """A real pod's processes by role (`PROCESSES`), from its API server's pid."""
    children: dict[int, list[tuple[str, int]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                comm, ppid = _stat(entry)
            except OSError:  # gone meanwhile
                continue
            children.setdefault(ppid, []).append((comm, int(entry)))
    found = {"API server": api_server}
    parent = api_server
    for role, comm in PROCESSES.items():  # each started by the one before
        pid = next((p for c, p in children.get(parent, []) if c == comm), None)
        if pid is None:
            break
        found[role] = parent = pid
    return found


def rss_mib(pid: int) -> float:
    """Resident memory of one process (all its threads), MiB."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * PAGE / 2**20


def pss_mib(pid: int) -> float:
    """Its proportional share: pages shared with the pod's other processes (torch's libraries)
    count a part in each, so the pod's sum is what it holds."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    raise ValueError(f"no Pss in /proc/{pid}/smaps_rollup")
