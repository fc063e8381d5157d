"""The fleet's faults trip no tenant breaker, end to end (real Envoy, extauthz, ledger, Redis,
PostgreSQL, one simulated pod): a pod SIGKILLed under a stream of each tier, and a pod failing
everyone. On a stack of its own: test_breaker_e2e.py's stack turns the pod rule off."""

from __future__ import annotations

import http.client
import time
from pathlib import Path

from tests.e2e.conftest import stack_settings
from tests.e2e.test_breaker_e2e import circuit_open, faults, open_breakers, stream
from tests.e2e.test_ledger_e2e import recorded
from tests.e2e.test_ratelimit_e2e import add_tenant, chat
from tools.stack import Stack


def broken(reply: http.client.HTTPResponse) -> bool:
    """The rest of a stream whose pod died: cut short (no [DONE]), however the client sees it."""
    try:
        rest = reply.read()
    except (http.client.HTTPException, OSError):
        return True
    return not rest.endswith(b"data: [DONE]\n\n")


def test_the_fleets_faults_trip_no_breaker(tmp_path: Path) -> None:
    """One pod, one stream of each tier on it, SIGKILLed: the streams break (Envoy: UC/UR), the
    requests sent while it is down find no pod (UH/UF), and none of it is any tenant's doing.
    Then the pod answers 500 to everyone: three tenants failed by it within 10 s make it the
    pod's fault (ledger/blame.py)."""
    with Stack(stack_settings(pods=1), tmp_path / "stack") as stack:
        tenants = {tier: f"kill-{tier}" for tier in ("free", "standard", "platinum")}
        keys = {tier: add_tenant(stack, tenant, tier) for tier, tenant in tenants.items()}
        seen: dict[str, list[int | str]] = {tier: [] for tier in keys}

        def send(tier: str) -> str:
            reply = chat(stack, keys[tier])
            seen[tier].append("circuit_open" if circuit_open(reply) else reply.status)
            return reply.headers["x-request-id"]

        streams = {tier: stream(stack, key) for tier, key in keys.items()}
        ids = {r.headers["x-request-id"] for _, r in streams.values()}
        stack.pod_processes[0].kill()
        for tier, (conn, reply) in streams.items():
            assert broken(reply)
            conn.close()
            seen[tier].append("broken stream")
        ids |= {send(tier) for _ in range(3) for tier in keys}  # while no pod is up
        pod = stack.pods[0]
        stack.restart_pod(0)
        stack.wait_healthy({f"{pod.host}:{pod.port}"})
        faults(stack, True)  # a pod failing everyone, its engine dead say
        try:
            ids |= {send(tier) for _ in range(3) for tier in keys}  # the tiers in turn
        finally:
            faults(stack, False)
        recorded(stack, ids)  # the ledger has every failure: each was fed to the breakers
        for tier in keys:
            deadline = time.monotonic() + 30
            while seen[tier][-1] != 200 and time.monotonic() < deadline:
                send(tier)
        assert all("circuit_open" not in s and s[-1] == 200 for s in seen.values()), seen
        assert open_breakers(stack, list(tenants.values())) == {}
        assert 500 in seen["free"]  # the pod did fail them
