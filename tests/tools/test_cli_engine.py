"""`llmgw up --engine` and `--vllm-arg` (tools/cli.py): the flags as stack settings, and the
combinations refused before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools import cli, launcher
from tools.stack import Stack, StackSettings


def settings(*argv: str) -> StackSettings:
    return cli._stack_settings(cli.parser().parse_args(["up", *argv]))


def test_the_engine_is_the_simulator_unless_asked() -> None:
    assert settings().engine == "sim"
    assert settings("--engine", "sim").engine == "sim"
    assert settings("--engine", "vllm", "--pods", "1").engine == "vllm"


def test_vllm_args_are_split_as_a_shell_would_and_kept_in_order() -> None:
    up = settings(
        "--engine",
        "vllm",
        "--vllm-arg",
        "--max-num-seqs 4",
        "--vllm-arg",
        """--kv-events-config '{"enable_kv_cache_events": true}'""",
    )
    assert up.vllm.args == (
        "--max-num-seqs",
        "4",
        "--kv-events-config",
        '{"enable_kv_cache_events": true}',
    )
    assert up.vllm.served_model_name == "llmgw/tiny-llama"  # the rest of vllm stays as it was


@pytest.mark.parametrize(
    ("argv", "complaint"),
    [
        (["--engine", "vllm", "--upstream", "vllm:8000"], "--engine vllm starts pods of its own"),
        (["--engine", "tgi"], "invalid choice: 'tgi'"),
    ],
)
def test_refused_combinations_are_argument_errors(
    argv: list[str], complaint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["up", *argv])
    assert exited.value.code == 2
    assert complaint in capsys.readouterr().err


def test_upstreams_alone_still_mean_pods_someone_else_runs() -> None:
    up = settings("--upstream", "vllm:8000")
    assert up.upstreams == ("vllm:8000",)
    assert up.engine == "sim"  # not used: the ready file says "external"


def test_up_runs_in_a_new_run_directory_and_passes_on_where_else_the_ready_file_goes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run directory of its own under --state-dir, where the launcher always writes the ready
    file (`llmgw usage`, `spend` and `keys` look there: tests/e2e/test_launcher.py); a
    --ready-file is a copy elsewhere."""
    given: list[tuple[Path, Path | None]] = []

    def supervise(stack: Stack, ready_file: Path | None) -> int:
        given.append((stack.state_dir, ready_file))
        return 0

    monkeypatch.setattr(launcher, "supervise", supervise)
    assert cli.main(["up", "--state-dir", str(tmp_path)]) == 0
    assert cli.main(["up", "--state-dir", str(tmp_path), "--ready-file", "up.json"]) == 0
    (run, default), (_, named) = given
    assert run.parent == tmp_path and run.name.startswith("run-")
    assert default is None and named == Path("up.json")
