"""The snapshot's map of a database source: a change copies only what it touches."""

from __future__ import annotations

from extauthz.sharded import SHARDS, Sharded


def test_a_change_shares_every_shard_it_does_not_touch() -> None:
    before = Sharded.of((i, str(i)) for i in range(10 * SHARDS))
    after = before.evolve({1: "one", -1: "new"}, drop=[2, 10**9])
    assert (after[1], after[-1], after.get(2), len(after)) == ("one", "new", None, len(before))
    assert (before[1], before.get(-1), before[2]) == ("1", None, "2")  # unchanged
    shared = sum(a is b for a, b in zip(before._shards, after._shards, strict=True))
    assert shared >= SHARDS - 3  # the shards of 1, -1 and 2; every other one the same dict
    assert sorted(after) == sorted([*(k for k in before if k != 2), -1])
