"""Each filter, scorer and the picker on hand-made candidates."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from llmgw import facts, wire
from router.plugins import (
    best_picker,
    healthy,
    kv_headroom,
    load,
    not_saturated,
    prefix_affinity,
    queue_depth,
    seed,
    serves_model,
    session_affinity,
    tenant_priority,
)
from router.prefix import PrefixIndex
from router.request import from_metadata
from router.types import Candidate, PickRequest
from tests.router.conftest import Clock, cand

REQ = PickRequest()


def pods(cands: list[Candidate]) -> list[str]:
    return [c.pod for c in cands]


def test_healthy_drops_unhealthy() -> None:
    f = healthy.factory("h", {})
    assert pods(f.filter(REQ, [cand("a"), cand("b", healthy=False)])) == ["a"]


def test_serves_model_keeps_pods_serving_it_or_not_yet_known() -> None:
    f = serves_model.factory("m", {})
    cands = [
        cand("a", models=frozenset({"llama"})),
        cand("b", models=frozenset({"qwen"})),
        cand("c"),
    ]
    assert pods(f.filter(PickRequest(model="llama"), cands)) == ["a", "c"]
    assert pods(f.filter(REQ, cands)) == ["a", "b", "c"]
    assert f.filter(PickRequest(model="gpt"), cands[:2]) == []


def test_not_saturated_drops_saturated_and_stale_unless_all_are() -> None:
    f = not_saturated.factory("s", {"kv_max": 0.9, "queue_max": 4})
    cands = [cand("a"), cand("b", kv=0.95), cand("c", waiting=4), cand("d", fresh=False)]
    assert pods(f.filter(REQ, cands)) == ["a"]
    assert pods(f.filter(REQ, cands[1:])) == ["b", "c", "d"]


def test_kv_headroom_prefers_free_cache_and_stale_scores_zero() -> None:
    s = kv_headroom.factory("kv", {})
    assert list(s.score(REQ, [cand("a", kv=0.2), cand("b", kv=0.9), cand("c", fresh=False)])) == (
        pytest.approx([0.8, 0.1, 0.0])
    )


def test_queue_depth_min_max_normalised() -> None:
    s = queue_depth.factory("q", {})
    assert list(
        s.score(REQ, [cand("a", waiting=0), cand("b", waiting=4), cand("c", waiting=2)])
    ) == [
        1.0,
        0.0,
        0.5,
    ]
    assert list(s.score(REQ, [cand("a", waiting=3), cand("b", waiting=3)])) == [1.0, 1.0]


def test_load_counts_running_and_in_flight() -> None:
    s = load.factory("l", {})
    scores = s.score(
        REQ, [cand("a", running=2), cand("b", running=2, in_flight=3), cand("c", fresh=False)]
    )
    assert list(scores) == pytest.approx([0.8, 0.5, 0.0])


def test_seed_formula() -> None:
    s = seed.factory("s", {"w1": 1, "w2": 1, "w3": 1, "theta": 0.8})
    # S = max(0, 0.9 - 0.8) + 2/10 + 5/10 = 0.8; S_max = 0.2 + 1 + 1 = 2.2
    a, b = s.score(REQ, [cand("a", kv=0.9, waiting=2, running=5), cand("b", kv=0.5)])
    assert a == pytest.approx(1 - 0.8 / 2.2)
    assert b == pytest.approx(1.0)


def test_tenant_priority_high_to_least_loaded_low_fills() -> None:
    s = tenant_priority.factory("p", {})
    cands = [cand("idle"), cand("busy", running=8)]
    assert list(s.score(PickRequest(priority=10), cands)) == pytest.approx([1.0, 0.2])
    assert list(s.score(PickRequest(priority=1), cands)) == pytest.approx([0.0, 0.8])
    assert list(s.score(PickRequest(priority=5), cands)) == [0.5, 0.5]


def test_session_affinity_is_stable_and_moves_only_sessions_of_a_removed_pod() -> None:
    s = session_affinity.factory("s", {})
    cands = [cand(f"10.0.0.{i}:8000") for i in range(8)]
    owners = {}
    for n in range(200):
        scores = s.score(PickRequest(session=f"sess_{n}"), cands)
        assert sorted(scores) == [0.0] * 7 + [1.0]
        owners[n] = cands[scores.index(1.0)].pod
    assert len(set(owners.values())) == 8  # spread over the fleet
    fewer = [c for c in cands if c.pod != "10.0.0.3:8000"]
    for n in range(200):
        scores = s.score(PickRequest(session=f"sess_{n}"), fewer)
        if owners[n] != "10.0.0.3:8000":
            assert fewer[scores.index(1.0)].pod == owners[n]
    assert list(s.score(REQ, cands)) == [0.0] * 8


def test_session_affinity_spills_over_in_rendezvous_order_when_its_pod_is_busy() -> None:
    s = session_affinity.factory("s", {"bound": 1.25, "slack": 1.0})
    cands = [cand("a"), cand("b"), cand("c")]
    req = PickRequest(session="sess_x")
    first = s.score(req, cands).index(1.0)
    cands[first] = cand(cands[first].pod, running=6)  # 7 > 1.25 * 7 / 3 + 1
    second = s.score(req, cands).index(1.0)
    assert second != first
    assert s.score(req, cands).index(1.0) == second  # deterministic: the same next pod
    cands = [cand(c.pod, running=1) for c in cands]  # 1 + 1 <= 1.25 * 4 / 3 + 1: keeps it
    assert s.score(req, cands).index(1.0) == first


def test_session_affinity_by_default_keeps_a_conversation_on_a_somewhat_busier_pod() -> None:
    """Moving it re-reads its whole prompt on another pod: twice the others' load is not yet
    worth that (bounds and imbalance thresholds both)."""
    s = session_affinity.factory("s", {})
    cands = [cand(f"10.0.0.{i}:8000", running=4) for i in range(4)]
    req = PickRequest(session="sess_x", prefix_blocks=(7,))
    home = list(s.score(req, cands)).index(1.0)
    cands[home] = cand(cands[home].pod, running=8)
    assert list(s.score(req, cands)).index(1.0) == home


def test_session_affinity_yields_when_its_pod_is_overloaded() -> None:
    params = {"bound": 100.0, "imbalance": {"abs_threshold": 0.2, "rel_threshold": 1.5}}
    s = session_affinity.factory("s", params)
    cands = [cand("a"), cand("b")]
    req = PickRequest(session="sess_x")
    owner = s.score(req, cands).index(1.0)
    cands[owner] = cand(cands[owner].pod, running=6)  # load 0.6 vs 0: imbalanced
    assert list(s.score(req, cands)) == [0.0, 0.0]
    cands[owner] = cand(cands[owner].pod, running=1)  # within the threshold: keeps affinity
    assert s.score(req, cands)[owner] == 1.0


def test_session_affinity_yields_to_what_the_pods_events_say_they_hold() -> None:
    """The home pod by rendezvous is a guess; a pod whose events say it holds more of the
    prompt than the home pod is not: affinity steps aside (prefix affinity then sends it
    there). Where the home holds as much as any, it stays home."""
    s = session_affinity.factory("s", {})
    cands = [cand("a"), cand("b")]
    req = PickRequest(session="sess_x", kv_blocks=(1, 2), kv_block_size=16)
    home = list(s.score(req, cands)).index(1.0)
    other = 1 - home
    cands[0].kv_held = cands[1].kv_held = 0  # both publish, neither holds it: the guess stays
    assert s.score(req, cands)[home] == 1.0
    cands[other].kv_held = 1
    assert list(s.score(req, cands)) == [0.0, 0.0]
    cands[home].kv_held = 1  # as much as any: home
    assert s.score(req, cands)[home] == 1.0


def test_session_affinity_skips_a_first_turn() -> None:
    s = session_affinity.factory("s", {})
    cands = [cand("a"), cand("b")]
    messages = [{"role": "user", "content": "hi"}]
    first = _request({"model": "m", "messages": messages})
    assert first.first_turn
    assert list(s.score(first, cands)) == [0.0, 0.0]
    messages += [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "?"}]
    later = _request({"model": "m", "messages": messages})
    assert not later.first_turn
    assert sorted(s.score(later, cands)) == [0.0, 1.0]


def test_session_affinity_homes_a_long_first_turn_where_its_next_turns_go() -> None:
    s = session_affinity.factory("s", {"first_turn_blocks": 32})
    cands = [cand(f"10.0.0.{i}:8000") for i in range(8)]
    system = {"role": "system", "content": "You are the assistant of ACME. " * 100}
    messages = [system, {"role": "user", "content": "hi"}]
    first = _request({"model": "m", "messages": messages})
    assert first.first_turn and first.prompt_tokens > 32 * 16
    messages += [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "?"}]
    later = _request({"model": "m", "messages": messages})
    home = list(s.score(later, cands)).index(1.0)
    assert list(s.score(first, cands)).index(1.0) == home


def test_session_affinity_homes_keys_in_proportion_to_pod_speed() -> None:
    s = session_affinity.factory("s", {"bound": 100.0})
    cands = [cand(f"10.0.0.{i}:8000") for i in range(4)]

    def homes(slow_speed: float) -> list[int]:
        cands[3].speed = slow_speed
        return [
            list(s.score(PickRequest(prefix_blocks=(n,)), cands)).index(1.0) for n in range(7000)
        ]

    half, full = homes(0.5), homes(1.0)
    assert [round(half.count(i) / 1000) for i in range(4)] == [2, 2, 2, 1]  # 1 : 1 : 1 : 0.5
    assert [round(full.count(i) / 1750) for i in range(4)] == [1, 1, 1, 1]
    # Getting faster, the pod only takes keys: no other key (and its KV) moves.
    assert all(f in (h, 3) for h, f in zip(half, full, strict=True))


def test_conversations_sharing_a_system_prompt_share_a_pod() -> None:
    s = session_affinity.factory("s", {})
    cands = [cand(f"10.0.0.{i}:8000") for i in range(8)]
    owners = set()
    for n in range(20):
        req = PickRequest(session=f"sess_{n}", prefix_blocks=(42, n))
        owners.add(list(s.score(req, cands)).index(1.0))
    assert len(owners) == 1
    roots = {list(s.score(PickRequest(prefix_blocks=(n,)), cands)).index(1.0) for n in range(50)}
    assert len(roots) == 8  # different prompts spread over the fleet


def _request(body: dict[str, Any]) -> PickRequest:
    """What the router gets for this body: extauthz's facts, forwarded by Envoy."""
    parsed = facts.from_body(
        body, chars_per_token=4, image_tokens=0, max_output=16, max_blocks=4, model="m"
    )
    return from_metadata({wire.META_SESSION: "sess_x", **parsed.to_metadata()})


def _blocks(text: str) -> tuple[int, ...]:
    return facts.block_hashes(facts.render({"messages": [{"role": "system", "content": text}]}), 64)


def test_prefix_affinity_prefers_the_pod_holding_the_longest_prefix() -> None:
    s = prefix_affinity.factory("p", {"placement": 0.0})
    a, b = cand("a"), cand("b")
    system = "You are a helpful assistant for ACME. " * 20
    first = _blocks(system + "Question one?" * 10)
    assert list(s.score(PickRequest(prefix_blocks=first), [a, b])) == [0.0, 0.0]
    s.observe(PickRequest(prefix_blocks=first), a)
    second = _blocks(system + "Another question entirely." * 10)
    scores = s.score(PickRequest(prefix_blocks=second), [a, b])
    assert 0.2 < scores[0] < 1.0 and scores[1] == 0.0
    assert s.score(PickRequest(prefix_blocks=first), [a, b])[0] == 1.0


def test_prefix_affinity_believes_the_pods_own_events_over_its_map() -> None:
    """The map says `a` holds the prompt (the router sent it there); a's events say it holds
    none of it (evicted) and b's that it holds half (another replica sent it there): b wins.
    A pod that publishes no events is still scored from the map."""
    s = prefix_affinity.factory("p", {"placement": 0.0})
    a, b, c = cand("a"), cand("b"), cand("c")
    prompt = _blocks("You are a helpful assistant for ACME. " * 40)
    req = PickRequest(
        prefix_blocks=prompt, kv_blocks=(1, 2, 3, 4), kv_block_size=128, prompt_tokens=1024
    )
    s.observe(req, a)
    s.observe(req, c)
    a.kv_held, b.kv_held = 0, 4
    assert list(s.score(req, [a, b, c])) == [0.0, 0.5, 1.0]
    # No pod's events show any of it (the pods may hash otherwise): the map decides.
    b.kv_held = 0
    assert list(s.score(req, [a, b, c])) == [1.0, 0.0, 1.0]
    # Holding every hashed block, a pod may hold more than they cover: the map says how much.
    req = PickRequest(prefix_blocks=prompt, kv_blocks=(1, 2), kv_block_size=128, prompt_tokens=1024)
    a.kv_held = 2
    assert s.score(req, [a, b])[0] == 1.0


def test_prefix_affinity_capacity_follows_pod_kv_size_and_evicts_lru() -> None:
    s = prefix_affinity.factory("p", {"placement": 0.0})
    small = cand("small", blocks=4)  # 4 blocks of 16 tokens: 4 of our blocks
    old = _blocks("old prompt text " * 40)
    new = _blocks("new prompt text " * 40)
    s.observe(PickRequest(prefix_blocks=old), small)
    s.observe(PickRequest(prefix_blocks=new), small)
    assert s.index.size("small") == 4
    assert s.score(PickRequest(prefix_blocks=old), [small]) == [0.0]
    assert s.score(PickRequest(prefix_blocks=new), [small])[0] == pytest.approx(4 / len(new))


def test_prefix_affinity_charges_every_block_of_the_prompt_not_only_the_hashed_ones() -> None:
    """64 hashed blocks of a 3000-token prompt are a third of its KV: the pod's map must fill,
    and evict, as the pod does."""
    s = prefix_affinity.factory("p", {"placement": 0.0})
    pod = cand("a", blocks=400)
    one = PickRequest(prefix_blocks=tuple(range(1, 65)), prompt_tokens=3000, session="s1")
    two = PickRequest(prefix_blocks=tuple(range(101, 165)), prompt_tokens=3000, session="s2")
    s.observe(one, pod)
    assert s.index.size("a") == 188  # ceil(3000 / 16)
    assert s.score(one, [pod]) == [1.0]  # its rest is held too
    s.observe(two, pod)  # 376 of 400
    assert s.score(one, [pod]) == [1.0]
    s.observe(PickRequest(prefix_blocks=tuple(range(201, 265)), prompt_tokens=3000), pod)
    # 564 blocks for 400: the least recently used prompt lost 164, its rest and last blocks
    # first, as a pod frees them; charging only hashed blocks, all three would still fit.
    assert list(s.score(one, [pod])) == pytest.approx([24 / 188])
    assert s.score(two, [pod]) == [1.0]


def test_conversations_on_one_system_prompt_share_its_rest_and_keep_their_own() -> None:
    index = PrefixIndex(clock=Clock())
    hashed = tuple(range(1, 65))  # a 2000-token system prompt, 64 blocks of it hashed
    index.record("a", hashed, "s1", 130, 10_000)  # first turns: system prompt + a question
    index.record("a", hashed, "s2", 131, 10_000)
    assert index.size("a") == 131  # one system prompt, and s2's one block more
    index.record("a", hashed, "s1", 160, 10_000)  # s1's third turn: its history grows
    assert index.size("a") == 130 + 1 + 30
    assert index.held(hashed, "s1", 170) == {"a": 160}  # its latest prompt; not the new turn
    assert index.held(hashed, "s3", 140) == {"a": 130}  # another session: the shared part


def test_prefix_affinity_places_a_new_prompt_where_it_evicts_the_coldest_blocks() -> None:
    clock = Clock()
    s = prefix_affinity.factory("p", {"placement": 0.5, "cold_s": 10.0})
    s.index.clock = clock
    warm, cold, roomy = cand("warm", blocks=300), cand("cold", blocks=300), cand("roomy")
    s.observe(PickRequest(prefix_blocks=(1,), prompt_tokens=4000), cold)  # 250 blocks
    clock.now += 30
    s.observe(PickRequest(prefix_blocks=(2,), prompt_tokens=4000), warm)
    new = PickRequest(prefix_blocks=(3,), prompt_tokens=1600)  # 100 blocks: 50 over
    scores = s.score(new, [warm, cold, roomy])
    assert scores[2] == 0.5  # fits without evicting anything
    assert scores[1] == pytest.approx(0.5 * 30 / 40)  # evicts what was idle for 30 s
    assert scores[0] == 0.0  # evicts what was read just now


def test_prefix_affinity_replicates_a_prefix_whose_pod_is_overloaded() -> None:
    s = prefix_affinity.factory("p", {})
    blocks = _blocks("shared system prompt " * 40)
    s.observe(PickRequest(prefix_blocks=blocks), cand("a"))
    busy = [cand("a", running=19), cand("b")]  # load 1.9 vs 0: imbalanced
    assert s.score(PickRequest(prefix_blocks=blocks), busy) == [0.5, 0.5]  # placed again
    s.observe(PickRequest(prefix_blocks=blocks), busy[1])
    both = s.index.match(blocks)
    assert both == {"a": len(blocks), "b": len(blocks)}  # now on two pods
    assert s.score(PickRequest(prefix_blocks=blocks), [cand("a", running=1), cand("b")]) == [
        1.0,
        1.0,
    ]


def test_picker_orders_best_first_and_bounds_the_answer() -> None:
    p = best_picker.factory("p", {"epsilon": 0.0, "max_endpoints": 2})
    cands = [cand("a"), cand("b"), cand("c")]
    ordered, explored = p.pick(cands, [0.1, 0.9, 0.5])
    assert pods(ordered) == ["b", "c"] and not explored


def test_picker_explores_only_among_near_equal_pods_and_at_most_max_ties() -> None:
    p = best_picker.factory("p", {"epsilon": 0.05, "max_ties": 3, "seed": 7})
    cands = [cand(str(i)) for i in range(6)]
    scores = [1.0, 0.99, 0.97, 0.96, 0.96, 0.5]
    firsts = Counter(p.pick(cands, scores)[0][0].pod for _ in range(600))
    assert set(firsts) == {"0", "1", "2"}  # 3 and 4 are near-equal too, but over max_ties
    assert min(firsts.values()) > 100  # a real spread, not a token one
    clear = [1.0, 0.5, 0.4, 0.3, 0.2, 0.1]
    assert {p.pick(cands, clear)[0][0].pod for _ in range(100)} == {"0"}


def test_a_prompt_larger_than_the_cache_evicts_all_without_walking_it() -> None:
    """What a prompt would evict, in seconds since its newest entry was used: a prompt as large
    as the cache evicts everything, answered without a walk over the pod's entries (a 2M-token
    prompt walked every pod's whole LRU: 165 ms of a pick at 256 pods)."""
    clock = Clock()
    index = PrefixIndex(clock=clock)
    for i in range(50):
        clock.now = 1000.0 + i
        index.record("a", (i,), None, 1, capacity=100)
    clock.now = 1100.0
    assert index.idle_evicted("a", 10, 100) == float("inf")  # 60 of 100: fits
    assert index.idle_evicted("a", 60, 100) == pytest.approx(100.0 - 9)  # the 10 oldest go
    assert index.idle_evicted("a", 10**6, 100) == pytest.approx(100.0 - 49)  # all of them
