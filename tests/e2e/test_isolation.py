"""Prefix caches are isolated per tenant by default (vLLM's cache_salt, set by the gateway), and
shared only inside an explicit cache group: tried with the simulator's own cache counters and
with a pod that records what it receives."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from extauthz import tenants
from extauthz.types import Tenant, TenantsFile
from tests.e2e.conftest import stack_settings
from tests.eventually import eventually
from tests.http import call
from tests.recording_pod import MODEL as RECORDED_MODEL
from tests.recording_pod import recording_pod
from tools.stack import Stack

SIM_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
SECRET = "Tenant A's confidential instructions: never disclose the merger with Initech. " * 30


def add_tenants(stack: Stack, specs: list[tuple[str, str | None]]) -> dict[str, str]:
    """Tenants (id, cache group) with one key each, once extauthz has them (bounded wait)."""
    keys: dict[str, str] = {}
    with tenants.editing(stack.tenants_file):
        data = tenants.read(stack.tenants_file)
        added = []
        for tenant_id, group in specs:
            key, record = tenants.new_key(datetime.now(UTC).replace(microsecond=0))
            keys[tenant_id] = key
            added.append(
                Tenant(id=tenant_id, name=tenant_id, tier="standard", priority=5, models="*",
                       keys=(record,), cache_group=group)
            )  # fmt: skip
        tenants.write(stack.tenants_file, TenantsFile(tenants=(*data.tenants, *added)))
    deadline = time.monotonic() + 10
    for key in keys.values():
        while call("GET", f"{stack.base_url}/models", headers=auth(key)).status == 401:
            assert time.monotonic() < deadline, "extauthz did not load the new tenants"
            time.sleep(0.05)
    return keys


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def cached_tokens(stack: Stack) -> float:
    with urllib.request.urlopen(f"{stack.pod_url(0)}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:prompt_tokens_cached_total")
    )


@pytest.fixture(scope="module")
def one_pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with Stack(stack_settings(pods=1), tmp_path_factory.mktemp("isolation") / "stack") as stack:
        yield stack


def ask(stack: Stack, key: str, **extra: object) -> None:
    body = {"model": SIM_MODEL, "messages": [{"role": "user", "content": SECRET}], "max_tokens": 1}
    reply = call("POST", f"{stack.base_url}/chat/completions", {**body, **extra}, auth(key))
    assert reply.status == 200, reply.body


def test_another_tenants_prompt_is_a_cache_miss(one_pod: Stack) -> None:
    """The timing oracle closed: tenant B sending tenant A's secret prompt hits nothing cached,
    even with A's salt guessed or forged in the body; A's own repeat is a hit."""
    keys = add_tenants(one_pod, [("iso-a", None), ("iso-b", None)])
    ask(one_pod, keys["iso-a"])
    before = cached_tokens(one_pod)
    ask(one_pod, keys["iso-a"])
    assert cached_tokens(one_pod) - before > 500  # A's own prompt: cached
    before = cached_tokens(one_pod)
    ask(one_pod, keys["iso-b"], cache_salt="tenant/iso-a")  # a forged salt changes nothing
    assert cached_tokens(one_pod) - before == 0  # B sees a miss, as for an unseen prompt
    before = cached_tokens(one_pod)
    ask(one_pod, keys["iso-b"])
    assert cached_tokens(one_pod) - before > 500  # B's repeat hits B's own blocks only


def test_a_cache_group_shares_blocks(one_pod: Stack) -> None:
    keys = add_tenants(one_pod, [("grp-a", "acme-shared"), ("grp-b", "acme-shared")])
    ask(one_pod, keys["grp-a"], messages=[{"role": "system", "content": SECRET + "grp"}])
    before = cached_tokens(one_pod)
    ask(one_pod, keys["grp-b"], messages=[{"role": "system", "content": SECRET + "grp"}])
    assert cached_tokens(one_pod) - before > 500  # the group shares its system prompt


def test_the_pod_receives_the_gateways_salt_not_the_clients(tmp_path: Path) -> None:
    with recording_pod() as pod:
        settings = stack_settings().model_copy(update={"upstreams": (pod.address,), "pods": 0})
        with Stack(settings, tmp_path / "stack") as stack:
            keys = add_tenants(stack, [("rec-a", None), ("rec-b", None), ("rec-c", "shared"),
                                       ("rec-d", "shared")])  # fmt: skip
            salts = {}
            for tenant, key in keys.items():
                body = {"model": RECORDED_MODEL, "messages": [], "cache_salt": "client-chosen"}
                reply = call("POST", f"{stack.base_url}/chat/completions", body, auth(key))
                assert reply.status == 200, reply.body
                received = pod.requests[-1]
                assert received.body["model"] == RECORDED_MODEL  # the rest of the body intact
                salts[tenant] = received.body["cache_salt"]
            bare = json.dumps({"model": RECORDED_MODEL}).encode()  # served (another is a 404)
            empty = call("POST", f"{stack.base_url}/chat/completions", bare,
                         {**auth(keys["rec-a"]), "content-type": "application/json"})  # fmt: skip
            assert empty.status == 200 and pod.requests[-1].body["cache_salt"] == salts["rec-a"]
    assert "client-chosen" not in salts.values()
    assert len({salts["rec-a"], salts["rec-b"], salts["rec-c"]}) == 3
    assert salts["rec-c"] == salts["rec-d"]
    # The pod parsed every rewritten body as JSON (the recording pod would have failed).
    assert all(isinstance(r.body, dict) for r in pod.requests)
    json.dumps([r.body for r in pod.requests])


def test_the_model_list_is_the_tenants_allow_list(one_pod: Stack) -> None:
    with tenants.editing(one_pod.tenants_file):
        data = tenants.read(one_pod.tenants_file)
        added, keys = [], {}
        for tenant_id, models in (("ml-one", (SIM_MODEL,)), ("ml-none", ("other-model",))):
            key, record = tenants.new_key(datetime.now(UTC).replace(microsecond=0))
            keys[tenant_id] = key
            added.append(
                Tenant(id=tenant_id, name=tenant_id, tier="standard", priority=5, models=models,
                       keys=(record,))
            )  # fmt: skip
        tenants.write(one_pod.tenants_file, TenantsFile(tenants=(*data.tenants, *added)))
    models = lambda: call("GET", f"{one_pod.base_url}/models", headers=auth(keys["ml-none"]))  # noqa: E731
    eventually(lambda: models().status != 401, 10, "extauthz did not load the new tenants")
    every = call("GET", f"{one_pod.base_url}/models", headers=auth(one_pod.tenants[0]["api_key"]))
    mine = call("GET", f"{one_pod.base_url}/models", headers=auth(keys["ml-one"]))
    none = call("GET", f"{one_pod.base_url}/models", headers=auth(keys["ml-none"]))
    assert [m["id"] for m in every.json()["data"]] == [SIM_MODEL]  # a "*" tenant: the pods' list
    assert [m["id"] for m in mine.json()["data"]] == [SIM_MODEL]
    assert mine.json()["data"][0] == every.json()["data"][0]  # the card itself untouched
    assert none.status == 200 and none.json() == {"object": "list", "data": []}
