"""Envoy's file access log reconciled against the ledger (ledger/filelog.py, ledger/reconcile.py):
the file's line and the gRPC entry make one outcome; the checkpoint moves only past what the
database has; what it lacks is handed over, once."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from envoy.data.accesslog.v3 import accesslog_pb2
from google.protobuf.json_format import MessageToDict
from pydantic import ValidationError

from ledger import metrics, sidecar
from ledger.entry import FLAG_CODES, flags, outcome_of, to_outcome
from ledger.filelog import Malformed, parse
from ledger.reconcile import Checkpoint, Database, Reconciler
from ledger.settings import Settings
from llmgw import wire
from llmgw.outcome import Outcome
from tests.ledger.conftest import outcome
from tests.ledger.test_entry import USED, entry
from tests.ledger.test_ledger_db import MakeLedger


def line(e: accesslog_pb2.HTTPAccessLogEntry) -> str:
    """The entry as Envoy's file access log prints it (envoy/envoy.yaml.j2)."""
    common = e.common_properties
    sock = common.upstream_remote_address.socket_address
    meta = common.metadata.filter_metadata

    def ns(name: str) -> Any:
        return MessageToDict(meta[name]) if name in meta else None

    us = common.duration.ToMicroseconds()
    return json.dumps(
        {
            "ts": common.start_time.ToJsonString(),
            "request_id": e.request.request_id or None,
            "method": "POST",
            "path": e.request.path,
            "status": e.response.response_code.value,
            "flags": ",".join(flags(common.response_flags)) or "-",
            "pod": f"{sock.address}:{sock.port_value}" if sock.address else None,
            "attempts": common.upstream_request_attempt_count,
            "bytes_in": 0,
            "bytes_out": 0,
            "duration_us": us,
            "ttft_us": common.time_to_first_downstream_tx_byte.ToMicroseconds(),
            "headers_in": 0,
            "headers_out": 0,
            wire.EXTAUTHZ_NAMESPACE: ns(wire.EXTAUTHZ_NAMESPACE),
            wire.USAGE_NAMESPACE: ns(wire.USAGE_NAMESPACE),
            wire.RATELIMIT_NAMESPACE: ns(wire.RATELIMIT_NAMESPACE),
        }
    )


CASES = {
    "ok": entry(200, usage=USED, admission={wire.META_DECIDED: True}),
    "stream cut": entry(
        0, stream=True, usage={wire.META_STREAMED_EVENTS: 4}, flags=("downstream_remote_reset",)
    ),
    "refused": entry(429, pod=None, flags=("rate_limited",)),
    "stranger": entry(401, pod=None, authenticated=False, flags=("unauthorized",)),
}


@pytest.mark.parametrize("case", CASES)
def test_the_file_and_the_grpc_log_make_one_outcome(case: str) -> None:
    e = CASES[case]
    assert outcome_of(parse(line(e))) == to_outcome(e)


def test_every_flag_reads_back() -> None:
    e = entry(503, flags=tuple(FLAG_CODES))
    assert outcome_of(parse(line(e))) == to_outcome(e)


@pytest.mark.parametrize("text", ['{"ts": "2026-', "[]", '{"request_id": 3}', "not json"])
def test_a_line_not_of_ours_is_malformed(text: str) -> None:
    with pytest.raises(Malformed):
        parse(text)


class Ledger:
    """The database and the recorder: whatever is added is known."""

    def __init__(self, loses: int = 0) -> None:
        self.ids: set[str] = set()
        self.added: list[str] = []
        self.loses = loses  # the next handovers lost (a ledger that died with them)
        self.down = False

    def add(self, outcomes: Sequence[Outcome]) -> None:
        self.added += [o.request_id for o in outcomes]
        if self.loses:
            self.loses -= 1
            return
        self.ids |= {o.request_id for o in outcomes}

    async def known(self, request_ids: Sequence[str]) -> set[str]:
        if self.down:
            raise OSError("database down")
        return self.ids & set(request_ids)

    async def close(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def write(path: Path, *ids: str, tail: str = "") -> None:
    with path.open("a") as f:
        for i in ids:
            f.write(line(entry(200, usage=USED, request_id=i)) + "\n")
        f.write(tail)


MADE: list[Reconciler] = []


@pytest.fixture(autouse=True)
async def _closed() -> AsyncIterator[None]:
    yield
    for r in MADE:
        await r.close()
    MADE.clear()


def reconciler(path: Path, ledger: Ledger, clock: Clock) -> Reconciler:
    MADE.append(Reconciler(path, ledger, ledger, lag_s=5.0, clock=clock))
    return MADE[-1]


def checkpoint(path: Path) -> Checkpoint | None:
    return Checkpoint.load(path.with_name(path.name + ".checkpoint"))


async def test_what_the_ledger_lacks_is_handed_over_once_it_had_time(tmp_path: Path) -> None:
    log, ledger, clock = tmp_path / "access.log", Ledger(), Clock()
    write(log, "a", "b", "c")
    ledger.ids = {"a", "c"}  # delivered by the gRPC path
    stranger = entry(401, pod=None, authenticated=False, request_id="s", flags=("unauthorized",))
    with log.open("a") as f:
        f.write(line(stranger) + "\n" + "garbage\n")
    r = reconciler(log, ledger, clock)
    before = metrics.RECONCILED._value.get()
    malformed = metrics.MISSING.labels("malformed")._value.get()
    await r.step()
    assert ledger.added == [] and checkpoint(log) is None  # the gRPC path may still deliver
    clock.now = 5.0
    await r.step()
    assert ledger.added == ["b"]  # not the stranger's, not the garbage
    assert r.gap().missing == 1  # the garbage (ledger/detectors.py: outcomes_missing)
    assert metrics.RECONCILED._value.get() == before + 1
    assert metrics.MISSING.labels("malformed")._value.get() == malformed + 1
    await r.step()
    assert checkpoint(log) == Checkpoint(log.stat().st_ino, log.stat().st_size)
    assert ledger.added == ["b"]


async def test_the_checkpoint_stops_at_the_first_record_the_database_lacks(
    tmp_path: Path,
) -> None:
    log, ledger, clock = tmp_path / "access.log", Ledger(loses=1), Clock()
    write(log, "a")
    first = log.stat().st_size
    write(log, "b", "c")
    ledger.ids = {"a", "c"}
    r = reconciler(log, ledger, clock)
    await r.step()
    clock.now = 5.0
    await r.step()  # "b" handed over and lost with a dying ledger
    assert checkpoint(log) == Checkpoint(log.stat().st_ino, first)
    clock.now = 9.0
    await r.step()
    assert ledger.added == ["b"]  # not again before the lag is over
    clock.now = 10.0
    await r.step()
    assert ledger.added == ["b", "b"]
    await r.step()
    assert checkpoint(log) == Checkpoint(log.stat().st_ino, log.stat().st_size)


async def test_a_restart_resumes_at_the_checkpoint(tmp_path: Path) -> None:
    log, ledger, clock = tmp_path / "access.log", Ledger(), Clock()
    write(log, "a", "b")
    first = reconciler(log, ledger, clock)
    await first.step()
    clock.now = 5.0
    await first.step()
    await first.step()
    partial = '{"ts": "2026-12-01T'
    write(log, "c", tail=partial)  # a line Envoy is still writing
    second = reconciler(log, ledger, clock)
    await second.step()
    clock.now = 10.0
    await second.step()
    assert ledger.added == ["a", "b", "c"]  # "a" and "b" not read again
    with log.open("a") as f:  # the partial line was not consumed: "d" is whole now
        f.write(line(entry(200, request_id="d"))[len(partial) :] + "\n")
    await second.step()
    clock.now = 15.0
    await second.step()
    assert ledger.added == ["a", "b", "c", "d"]


async def test_a_rotated_file_is_read_to_its_end(tmp_path: Path) -> None:
    log, ledger, clock = tmp_path / "access.log", Ledger(), Clock()
    write(log, "a")
    r = reconciler(log, ledger, clock)
    await r.step()
    write(log, "b")
    log.rename(tmp_path / "access.log.1")
    write(log, "c")
    await r.step()
    await r.step()
    clock.now = 5.0
    await r.step()
    assert sorted(ledger.added) == ["a", "b", "c"]


async def test_nothing_moves_while_the_database_is_down(tmp_path: Path) -> None:
    log, ledger, clock = tmp_path / "access.log", Ledger(), Clock()
    write(log, "a")
    ledger.down = True
    r = reconciler(log, ledger, clock)
    await r.step()
    clock.now = 5.0
    with pytest.raises(OSError):
        await r.step()
    assert ledger.added == [] and checkpoint(log) is None
    ledger.down = False
    await r.step()
    await r.step()
    assert ledger.added == ["a"]
    assert checkpoint(log) == Checkpoint(log.stat().st_ino, log.stat().st_size)


async def test_the_database_knows_what_it_stored(db: str, make_ledger: MakeLedger) -> None:
    ledger = make_ledger(db)
    await ledger.start()
    ledger.submit([outcome(1), outcome(2)])
    await ledger.close()
    known = Database(db)
    try:
        assert await known.known([outcome(1).request_id, outcome(3).request_id]) == {
            outcome(1).request_id
        }
    finally:
        await known.close()


class Holding:
    def __init__(self, ids: set[str]) -> None:
        self.ids = ids

    def holding(self, request_ids: set[str]) -> set[str]:
        return self.ids & request_ids


async def test_what_the_live_path_holds_is_not_handed_over(tmp_path: Path) -> None:
    """E.g. waiting for Redis in the recorder: counted and stored once, by the live path."""
    log, ledger, clock = tmp_path / "access.log", Ledger(), Clock()
    write(log, "a", "b")
    live = Holding({"a"})
    MADE.append(r := Reconciler(log, ledger, ledger, lag_s=5.0, clock=clock, holders=[live]))
    await r.step()
    clock.now = 5.0
    await r.step()
    assert ledger.added == ["b"]
    await r.step()
    assert checkpoint(log) is None  # "a" is not durable yet
    live.ids.clear()
    ledger.ids.add("a")  # written by the live path
    await r.step()
    assert ledger.added == ["b"]
    assert checkpoint(log) == Checkpoint(log.stat().st_ino, log.stat().st_size)


async def test_no_more_than_held_max_records_are_read_ahead(tmp_path: Path) -> None:
    log, ledger, clock = tmp_path / "access.log", Ledger(), Clock()
    write(log, "a", "b", "c")
    ledger.down = True
    MADE.append(r := Reconciler(log, ledger, ledger, lag_s=5.0, clock=clock, held_max=1))
    await r.step()
    assert metrics.UNCONFIRMED._value.get() == 1
    ledger.down = False
    for _ in range(9):  # each record: read, handed over, confirmed
        clock.now += 5.0
        await r.step()
    assert ledger.added == ["a", "b", "c"]


async def test_a_draining_sidecar_hands_over_the_rest_without_waiting(tmp_path: Path) -> None:
    log, ledger = tmp_path / "access.log", Ledger()
    write(log, "a", "b")
    ledger.ids = {"a"}
    r = Reconciler(log, ledger, ledger, lag_s=3600.0, interval_s=0.01)
    await r.close(drain_s=30.0)
    assert ledger.added == ["b"]
    assert checkpoint(log) == Checkpoint(log.stat().st_ino, log.stat().st_size)


def test_the_sidecar_refuses_settings_without_an_access_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = tmp_path / "ledger.yaml"
    settings.write_text("database_url: postgresql://u:p@db/ledger\n")
    assert sidecar.cli(["--check-config", str(settings)]) == 1
    assert "reconcile.access_log" in capsys.readouterr().err
    settings.write_text(f"{settings.read_text()}reconcile: {{access_log: {tmp_path}/access.log}}\n")
    assert sidecar.cli(["--check-config", str(settings)]) == 0


def test_the_ledger_refuses_to_reconcile_without_a_database() -> None:
    with pytest.raises(ValidationError, match="needs database_url"):
        Settings.model_validate({"reconcile": {"access_log": "/var/log/envoy/access.log"}})
