"""One fleet of a real vLLM pod and a simulated one (`sim_pods`): the simulated pod serves the
same model, context and KV block size as the real one, the router picks both, both serve the
OpenAI SDK through the gateway, and the ledger settles both. Both publish their KV events: the
block hashes the gateway computes for a request are the ones the pod that served it publishes,
and the router sends a conversation to the pod that holds it, whoever put it there."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from llmgw import kvevents, wire
from tests.e2e.conftest import api_key
from tests.e2e.realpods import MARKS, model, real_stack, sdk
from tests.e2e.test_auth import access_log
from tests.e2e.test_isolation import add_tenants
from tests.e2e.test_ledger_e2e import recorded
from tests.e2e.test_vllm import noise
from tests.eventually import eventually
from tools.engine import BLOCK_SIZE
from tools.stack import Stack

pytestmark = MARKS


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with real_stack(tmp_path_factory.mktemp("fleet") / "stack", pods=1, sim_pods=1) as stack:
        yield stack


def pod_get(stack: Stack, index: int, path: str) -> bytes:
    request = urllib.request.Request(
        stack.pod_url(index) + path, headers={"authorization": f"Bearer {stack.pod_api_key}"}
    )
    with urllib.request.urlopen(request, timeout=10) as reply:
        return bytes(reply.read())


def served_as(stack: Stack, index: int) -> tuple[Any, ...]:
    """What the pod says it serves: its model card's id and context, its KV block size."""
    (card,) = json.loads(pod_get(stack, index, "/v1/models"))["data"]
    text = pod_get(stack, index, "/metrics").decode()
    families = text_string_to_metric_families(text)
    (config,) = (f for f in families if f.name == "vllm:cache_config_info")
    return card["id"], card["max_model_len"], config.samples[0].labels["block_size"]


def test_the_simulated_pod_serves_what_the_real_one_does(mixed: Stack) -> None:
    pods = mixed.ready_info()["pods"]
    assert [(p["engine"], p["simulated"]) for p in pods] == [("vllm", False), ("sim", True)]
    assert served_as(mixed, 1) == served_as(mixed, 0)
    real = (model(mixed), mixed.settings.vllm.max_model_len, str(BLOCK_SIZE))
    assert served_as(mixed, 0) == real


def test_both_pods_are_picked_and_the_ledger_settles_both(mixed: Stack) -> None:
    """Rounds of concurrent SDK requests (the router spreads what queues) until each pod has
    served some: bounded, a pod never picked fails the test."""
    pods = {f"{p.host}:{p.port}" for p in mixed.pods}

    def ask(i: int) -> str:
        reply = client.chat.completions.with_raw_response.create(
            model=model(mixed),
            messages=[{"role": "user", "content": f"question {i}"}],
            max_tokens=16,
            extra_body={"ignore_eos": True},
        )
        completion = reply.parse()
        assert completion.usage is not None and completion.usage.completion_tokens == 16
        return str(reply.headers["x-request-id"])

    rows: dict[str, Any] = {}
    with sdk(mixed, api_key(mixed, "standard")) as client, ThreadPoolExecutor(4) as pool:
        for round_ in range(20):
            ids = set(pool.map(ask, range(4 * round_, 4 * round_ + 4)))
            rows |= recorded(mixed, ids)
            if {r["pod"] for r in rows.values()} == pods:
                break
    assert {r["pod"] for r in rows.values()} == pods
    with urllib.request.urlopen(mixed.metrics["router"], timeout=10) as reply:
        picks = reply.read().decode()
    for pod in pods:
        assert f'llmgw_router_picks_total{{pod="{pod}"' in picks  # the router's pick, no fallback
        mine = [r for r in rows.values() if r["pod"] == pod]
        assert all(r["outcome"] == "ok" and r["completion_tokens"] == 16 for r in mine)
        assert all(r["prompt_tokens"] > 0 for r in mine)


def published(stack: Stack, index: int) -> set[int]:
    """Every block pod `index` has published as stored, from its replay socket (all it keeps)."""
    endpoint = stack.kv_events[index]
    assert endpoint.replay is not None
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    hashes: set[int] = set()
    try:
        sock.connect(endpoint.replay)
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        while (frames := sock.recv_multipart())[2] != kvevents.END_SEQUENCE:
            for event in kvevents.decode(frames[3]).events:
                if isinstance(event, kvevents.BlockStored):
                    hashes.update(map(kvevents.hash_value, event.block_hashes))
    finally:
        ctx.destroy(linger=0)
    return hashes


def extauthz_facts(stack: Stack, request_id: str) -> dict[str, Any]:
    """What extauthz published for the request (its namespace in Envoy's access log)."""
    found: dict[str, Any] = access_log(stack, request_id)[wire.EXTAUTHZ_NAMESPACE]  # type: ignore[assignment]
    return found


def kv_blocks(stack: Stack, request_id: str) -> tuple[int, ...]:
    hexes = extauthz_facts(stack, request_id)[wire.META_KV_BLOCKS]
    return tuple(int(hexes[i : i + 16], 16) for i in range(0, len(hexes), 16))


def ask(stack: Stack, key: str, system: str, question: str) -> tuple[str, int]:
    """A chat through the gateway: its request ID and prompt tokens."""
    with sdk(stack, key) as client:
        reply = client.chat.completions.with_raw_response.create(
            model=model(stack),
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
            max_tokens=1,
        )
    usage = reply.parse().usage
    assert usage is not None
    return str(reply.headers["x-request-id"]), usage.prompt_tokens


def test_the_gateways_block_hashes_are_the_ones_each_pod_publishes(mixed: Stack) -> None:
    """For each request, the hashes extauthz computed (its tokenizer, the chat template, the
    tenant's cache salt, the pods' hash and seed) are among the ones the pod that served it
    published in its KV events: the real vLLM pod and the simulated one alike. Requests until
    both pods served one (bounded)."""
    pods = [f"{p.host}:{p.port}" for p in mixed.pods]
    keys = add_tenants(mixed, [("kv-a", None), ("kv-b", None)])
    served: dict[str, list[tuple[str, int]]] = {pod: [] for pod in pods}
    for i in range(12):
        request_id, prompt = ask(mixed, keys["kv-a"], noise(f"kv {i}", 700), "Why?")
        pod = recorded(mixed, {request_id})[request_id]["pod"]
        served[pod].append((request_id, prompt))
        if all(served.values()):
            break
    assert all(served.values()), {pod: len(ids) for pod, ids in served.items()}
    for index, pod in enumerate(pods):
        held = published(mixed, index)
        for request_id, prompt in served[pod]:
            blocks = kv_blocks(mixed, request_id)
            assert len(blocks) == prompt // BLOCK_SIZE >= 4  # every full block, hashed
            assert set(blocks) <= held, f"pod {index} published other hashes for {request_id}"
    # The same prompt: the same hashes for one tenant, none shared with another tenant's.
    system = noise("kv salted", 700)
    a1, _ = ask(mixed, keys["kv-a"], system, "Why?")
    a2, _ = ask(mixed, keys["kv-a"], system, "Why?")
    b, _ = ask(mixed, keys["kv-b"], system, "Why?")
    assert kv_blocks(mixed, a1) == kv_blocks(mixed, a2)
    assert not set(kv_blocks(mixed, a1)) & set(kv_blocks(mixed, b))


def applied(stack: Stack) -> float:
    with urllib.request.urlopen(stack.metrics["router"], timeout=10) as reply:
        text = reply.read().decode()
    families = text_string_to_metric_families(text)
    return sum(
        s.value
        for f in families
        if f.name == "llmgw_router_kv_event_batches"
        for s in f.samples
        if s.name.endswith("_total") and s.labels.get("result") in ("applied", "replayed")
    )


def settled_batches(stack: Stack) -> float:
    """The batches applied, once none has come for a second (bounded)."""
    last, since = applied(stack), time.monotonic()
    deadline = since + 30
    while time.monotonic() - since < 1.0:
        assert time.monotonic() < deadline, "the pods' events never settled"
        time.sleep(0.1)
        now = applied(stack)
        if now != last:
            last, since = now, time.monotonic()
    return last


def test_a_prefix_cached_by_another_sender_is_routed_to_its_pod(mixed: Stack) -> None:
    """What the router never sent anywhere itself (another replica's pick, a client of the pod
    itself): a conversation put on a pod behind the router's back, with the tenant's cache salt.
    Its next turn through the gateway goes to that pod, each of four times (the approximate map
    knows nothing of it: by chance 1 in 16)."""
    (key,) = add_tenants(mixed, [("kv-elsewhere", None)]).values()
    first, _ = ask(mixed, key, "Be brief.", "Hi")
    suffix = extauthz_facts(mixed, first)[wire.META_BODY_SUFFIX]
    salt = json.loads("{" + suffix.lstrip(",") + "}")["cache_salt"]
    pods = [f"{p.host}:{p.port}" for p in mixed.pods]
    for i, target in enumerate([0, 1, 0, 1]):
        system = noise(f"elsewhere {i}", 700)
        before = settled_batches(mixed)  # the last request's events in, none on the way
        body = {
            "model": model(mixed),
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}],
            "max_tokens": 1,
            "cache_salt": salt,
        }
        request = urllib.request.Request(
            mixed.pod_url(target) + "/v1/chat/completions",
            json.dumps(body).encode(),
            {"authorization": f"Bearer {mixed.pod_api_key}", "content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as reply:
            assert reply.status == 200
        got = lambda seen=before: applied(mixed) > seen  # noqa: E731
        eventually(got, 30, "the router never got the pod's events")
        request_id, _ = ask(mixed, key, system, "And then?")
        assert recorded(mixed, {request_id})[request_id]["pod"] == pods[target], i
