"""One fleet of a real vLLM pod and a simulated one (`sim_pods`): the simulated pod serves the
same model, context and KV block size as the real one, the router picks both, both serve the
OpenAI SDK through the gateway, and the ledger settles both."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import api_key
from tests.e2e.realpods import MARKS, model, real_stack, sdk
from tests.e2e.test_ledger_e2e import recorded
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
