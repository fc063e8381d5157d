"""No outcome lost: every request Envoy answered for a tenant reaches the ledger exactly once,
whatever happens to the ledger meanwhile (issue 25).

Load of mixed stream and non-stream requests from several tenants, the ledger SIGKILLed (or
stopped by SIGTERM) in the middle of it and started again, more load; then every request the
clients got an answer to is in `llmgw usage --json` once, matched by its `x-request-id`.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ledger.entry import outcome_of
from ledger.filelog import parse
from tests.e2e.conftest import stack_settings
from tests.e2e.test_ledger_e2e import recorded, records
from tests.e2e.test_ratelimit_e2e import MODEL, auth
from tests.http import call
from tools.stack import Stack

RATE = 10.0  # requests a second, about


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    with Stack(stack_settings(), tmp_path / "stack") as running:
        yield running


class Load:
    """Requests at about RATE a second until stopped; the request IDs of those answered."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.answered: list[str] = []
        self.stopping = threading.Event()
        self.sent = 0

    def one(self, i: int) -> None:
        tenant = self.stack.tenants[i % len(self.stack.tenants)]
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"hello {i}"}],
            "max_tokens": 8 + i % 24,
            "stream": i % 2 == 0,
        }
        url = f"{self.stack.base_url}/chat/completions"
        try:
            reply = call("POST", url, body, auth(tenant["api_key"]), timeout=30)
        except OSError:
            return  # no answer: nothing Envoy answered
        if reply.status < 500 and "x-request-id" in reply.headers:
            self.answered.append(reply.headers["x-request-id"])

    def run(self, seconds: float) -> None:
        with ThreadPoolExecutor(16) as pool:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                pool.submit(self.one, self.sent)
                self.sent += 1
                time.sleep(1 / RATE)


def _ledger_down_under_load(stack: Stack, kill: bool) -> None:
    load = Load(stack)
    first = threading.Thread(target=load.run, args=(4.0,))
    first.start()
    time.sleep(2.0)  # mid-load: batches on their way and unsettled in the ledger
    ledger = next(p for p in stack.processes if p.name == "ledger")
    if kill:
        ledger.kill()
    else:
        ledger.stop()
    first.join()
    stack.restart("ledger")
    load.run(3.0)
    ids = set(load.answered)
    assert len(ids) == len(load.answered) > 30
    deadline = time.monotonic() + 60
    while True:
        counts = Counter(r["request_id"] for r in records(stack) if r["request_id"] in ids)
        missing = ids - set(counts)
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not missing, f"{len(missing)} of {len(ids)} answered requests not in the ledger"
    assert set(counts.values()) == {1}


# What the file's line must give exactly as the gRPC entry does (timings differ in precision).
SAME = (
    "tenant", "tier", "session", "key_id", "model", "endpoint", "pod", "status", "flags",
    "attempts", "stream", "outcome", "prompt_tokens", "completion_tokens", "cached_tokens",
    "reserved_tokens", "borrowed_requests", "borrowed_tokens", "bytes_in",
    "bytes_out",
)  # fmt: skip


def test_the_file_and_the_grpc_log_make_one_outcome(stack: Stack) -> None:
    """Real Envoy's two logs of the same requests, read by ledger/filelog.py and by the ledger's
    gRPC service: the same outcome, field by field."""
    load = Load(stack)
    for i in range(8):
        load.one(i)
    ids = set(load.answered)
    assert len(ids) == 8
    rows = recorded(stack, ids)
    lines = [json.loads(line) for line in stack.access_log.read_text().splitlines()]
    by_id = {line["request_id"]: line for line in lines if line["request_id"] in ids}
    for rid, row in rows.items():
        outcome = outcome_of(parse(json.dumps(by_id[rid])))
        assert outcome is not None
        assert {k: getattr(outcome, k) for k in SAME} == {k: row[k] for k in SAME}, rid
        assert outcome.duration_ms == pytest.approx(row["duration_ms"], abs=1.0)


def test_no_outcome_lost_when_the_ledger_is_killed(stack: Stack) -> None:
    _ledger_down_under_load(stack, kill=True)


def test_no_outcome_lost_when_the_ledger_is_stopped(stack: Stack) -> None:
    _ledger_down_under_load(stack, kill=False)
