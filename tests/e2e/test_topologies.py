"""One request through each named topology (llmgw/topology.py): the stack on free ports, real
Envoy in front. The check goes over the topology's transport, the service it runs apart is
called (and no other), and the rate limiter admits and the router picks wherever they run."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest

from llmgw.topology import Topology
from tests.e2e.conftest import PATIENT_SCRAPES, api_key, stack_settings
from tests.http import call
from tools.stack import Stack

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
# Envoy's counters of each way a request may travel: a check answered over HTTP or over gRPC
# (the access-log streams to extauthz stay open, so they complete no request there), a
# rate-limit call, an ext_proc call.
PATHS = {
    "http check": "cluster.extauthz_http.upstream_rq_200",
    "grpc check": "cluster.extauthz.upstream_rq_200",
    "rate-limit call": "cluster.ratelimit.upstream_rq_200",
    "ext_proc call": "http.openai.ext_proc.streams_started",
}
TAKEN = {
    Topology.GATEWAY: {"http check"},
    Topology.GRPC_CHECK: {"grpc check"},
    Topology.RLS: {"grpc check", "rate-limit call"},
    Topology.EPP: {"grpc check", "ext_proc call"},
}


def picks(stack: Stack) -> float:
    """The router's picks over every pod (served by extauthz when the router runs inside)."""
    with urllib.request.urlopen(stack.metrics["router"], timeout=5) as reply:
        lines = reply.read().decode().splitlines()
    return sum(
        float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith("llmgw_router_picks_total{")
    )


@pytest.mark.parametrize("topology", list(Topology))
def test_a_request_through_each_topology(
    topology: Topology, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in PATIENT_SCRAPES.items():  # the one request is picked however busy
        monkeypatch.setenv(name, value)
    settings = stack_settings().model_copy(update={"topology": topology})
    with Stack(settings, tmp_path / "stack") as stack:
        assert stack.services.topology is topology
        before, picked = stack.envoy_stats(), picks(stack)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        headers = {"authorization": f"Bearer {api_key(stack)}"}
        reply = call("POST", f"{stack.base_url}/chat/completions", body, headers)
        assert reply.status == 200, reply.body
        assert "x-ratelimit-remaining-requests" in reply.headers  # admitted by the limiter
        assert picks(stack) - picked == 1
        after = stack.envoy_stats()
        taken = {path for path, stat in PATHS.items() if after.get(stat, 0) > before.get(stat, 0)}
        assert taken == TAKEN[topology]
