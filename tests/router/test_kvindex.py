"""The KV index (router/kvindex.py): what each pod's events say it holds, looked up by a
request's leading blocks."""

from __future__ import annotations

from router.kvindex import KvIndex
from tests.router.conftest import cand


def test_a_lookup_counts_the_leading_blocks_each_pod_holds() -> None:
    index = KvIndex()
    index.stored("a", [1, 2, 3], 16)
    index.stored("b", [1, 2], 16)
    index.stored("c", [2, 3], 16)  # not the first block: holds no prefix of the request
    assert index.match((1, 2, 3, 4), 16) == {"a": 3, "b": 2}
    index.removed("a", [2])  # a pod evicts a prompt's last blocks first; a hole ends the match
    assert index.match((1, 2, 3), 16) == {"a": 1, "b": 2}
    index.removed("b", [7])  # never held: nothing to do
    assert index.match((1, 2, 3), 16)["b"] == 2


def test_only_pods_of_the_requests_block_size_answer() -> None:
    index = KvIndex()
    index.stored("gpu", [1, 2], 16)
    index.stored("cpu", [1, 2], 128)
    assert index.match((1, 2), 16) == {"gpu": 2}
    assert index.match((1, 2), 128) == {"cpu": 2}


def test_cleared_is_known_empty_and_dropped_is_unknown() -> None:
    index = KvIndex()
    index.stored("a", [1, 2], 16)
    index.stored("b", [1, 2], 16)
    index.cleared("a")
    index.drop("b")
    cands = [cand("a"), cand("b"), cand("c")]
    index.annotate((1, 2), 16, cands)
    # a publishes and holds none; b and c are not known (the approximate map decides for them).
    assert [c.kv_held for c in cands] == [0, None, None]
    assert index.entries() == 0
    index.stored("a", [1], 16)
    index.annotate((1, 2), 16, cands)
    assert cands[0].kv_held == 1


def test_a_pod_reporting_more_than_any_cache_holds_is_forgotten() -> None:
    index = KvIndex(max_blocks=100)
    index.stored("a", range(100), 16)
    assert index.size("a") == 100
    index.stored("a", [100], 16)
    assert not index.publishes("a") and index.entries() == 0


def test_a_block_on_several_pods_stays_with_the_others_when_one_evicts_it() -> None:
    index = KvIndex()
    for pod in "abc":
        index.stored(pod, [1], 16)
    index.removed("a", [1])
    assert index.match((1,), 16) == {"b": 1, "c": 1}
    index.removed("b", [1])
    assert index.match((1,), 16) == {"c": 1}
    index.stored("a", [1], 16)
    assert index.match((1,), 16) == {"a": 1, "c": 1}
    index.cleared("c")
    index.cleared("a")
    assert index.entries() == 0 and index.match((1,), 16) == {}
