"""Tenant priority reaches vLLM's scheduler through the real Envoy, and a client's never does."""

from __future__ import annotations

import http.client
import json
import threading
import urllib.request
from pathlib import Path

from llmgw import priority, wire
from tests.e2e.conftest import api_key, stack_settings
from tests.eventually import eventually
from tests.http import call
from tests.recording_pod import MODEL, recording_pod
from tools.stack import Stack

DEMO_PRIORITY = {"free": 2, "platinum": 9}  # extauthz/demo.py
FORGED = {wire.HEADER_VLLM_PRIORITY: "-100"}


def post(stack: Stack, tier: str, body: dict[str, object]) -> int:
    headers = {"authorization": f"Bearer {api_key(stack, tier)}", **FORGED}
    return call("POST", f"{stack.base_url}/chat/completions", body, headers, timeout=60).status


def test_the_pod_receives_the_tenants_priority_never_the_clients(tmp_path: Path) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "priority": -100}
    with recording_pod() as pod:
        settings = stack_settings().model_copy(update={"upstreams": (pod.address,), "pods": 0})
        with Stack(settings, tmp_path / "stack") as stack:
            assert post(stack, "free", body) == 200
            assert post(stack, "platinum", body) == 200
    free, platinum = pod.requests
    for received, tier in ((free, "free"), (platinum, "platinum")):
        expected = str(priority.vllm_priority(DEMO_PRIORITY[tier]))
        assert received.headers[wire.HEADER_VLLM_PRIORITY] == expected  # one value, ours
        # The body goes through as sent (no rewrite): vLLM lets the header override it.
        assert received.body["priority"] == -100
    assert free.headers[wire.HEADER_VLLM_PRIORITY] == "8"
    assert platinum.headers[wire.HEADER_VLLM_PRIORITY] == "1"


def test_without_extauthz_a_client_priority_header_is_still_stripped(tmp_path: Path) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    with recording_pod() as pod:
        settings = stack_settings().model_copy(
            update={"upstreams": (pod.address,), "pods": 0, "services": ()}
        )
        with Stack(settings, tmp_path / "stack") as stack:
            url = f"{stack.base_url}/chat/completions"
            assert call("POST", url, body, FORGED).status == 200
    (received,) = pod.requests
    assert wire.HEADER_VLLM_PRIORITY not in received.headers


def waiting(stack: Stack) -> float:
    with urllib.request.urlopen(f"{stack.pod_url(0)}/metrics", timeout=5) as resp:
        lines = resp.read().decode().splitlines()
    return sum(
        float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith("vllm:num_requests_waiting{")
    )


def eventually_waiting(stack: Stack, count: int) -> None:
    what = f"the pod never had {count} requests waiting"
    eventually(lambda: waiting(stack) == count, 30, what, every_s=0.02)


def test_the_pod_serves_the_more_important_tenant_first_whatever_the_body_says(
    tmp_path: Path,
) -> None:
    """One sequence at a time: a blocker runs, a free request that asks for priority -1000 in its
    body queues, then a platinum one. Released together, platinum must be served first: fcfs, or
    a body that beat the header, would serve the free one first (it came first, and -1000 < 1)."""
    settings = stack_settings(pods=1).model_copy(
        update={
            "sim_args": ("--time-scale", "0.05", "--max-num-seqs", "1"),
            "services": ("extauthz",),
        }
    )
    with Stack(settings, tmp_path / "stack") as stack:
        model = call(
            "GET", f"{stack.base_url}/models", headers={"authorization": f"Bearer {api_key(stack)}"}
        ).json()["data"][0]["id"]
        # The blocker streams until we hang up: nothing in the test depends on its speed.
        blocker = http.client.HTTPConnection(stack.listen.host, stack.listen.port, timeout=60)
        blocker.request(
            "POST",
            "/v1/chat/completions",
            json.dumps({"model": model, "messages": [{"role": "user", "content": "block"}],
                        "max_tokens": 100_000, "ignore_eos": True, "stream": True}),
            {"authorization": f"Bearer {api_key(stack, 'standard')}",
             "content-type": "application/json"},
        )  # fmt: skip
        stream = blocker.getresponse()
        assert stream.status == 200
        stream.readline()  # running now
        done: list[str] = []

        def send(tier: str, extra: dict[str, object]) -> None:
            # Long enough (~0.1 s each at this time scale) that the order the two finish in is
            # the pod's, not the client threads' scheduling on a busy machine.
            body = {"model": model, "messages": [{"role": "user", "content": tier}],
                    "max_tokens": 400, "ignore_eos": True, **extra}  # fmt: skip
            assert post(stack, tier, body) == 200
            done.append(tier)

        threads = [
            threading.Thread(target=send, args=("free", {"priority": -1000})),
            threading.Thread(target=send, args=("platinum", {})),
        ]
        for count, thread in enumerate(threads, start=1):
            thread.start()
            eventually_waiting(stack, count)  # queued in this order
        blocker.close()  # the pod aborts it; the waiting heap decides who runs next
        for thread in threads:
            thread.join(60)
    assert done == ["platinum", "free"]
