"""The block pool: private blocks, shared cached blocks, LRU eviction."""

from __future__ import annotations

from sim.kvcache import BlockPool
from sim.tokens import block_hashes


def test_allocation_fails_when_full_and_release_frees() -> None:
    pool = BlockPool(4)
    assert pool.allocate(3) and not pool.allocate(2)
    assert pool.usage() == 0.75
    pool.release([], 3)
    assert pool.used == 0 and pool.allocate(4)


def test_cached_blocks_are_shared_and_stay_after_release() -> None:
    pool = BlockPool(8)
    chain = block_hashes("a" * 64 * 3, 16)
    assert pool.allocate(3)
    assert all(pool.promote(h) for h in chain)
    assert not pool.promote(chain[0])  # already cached
    pool.acquire(chain[:2])  # a second sequence shares two blocks
    assert pool.used == 3
    pool.release(chain, 0)
    assert pool.used == 2 and pool.cached_prefix(chain) == 3
    pool.release(chain[:2], 0)
    assert pool.used == 0 and pool.cached_prefix(chain) == 3  # evictable, still cached


def test_eviction_takes_the_oldest_unreferenced_blocks_first() -> None:
    pool = BlockPool(4)
    old, new = block_hashes("o" * 128, 16), block_hashes("n" * 128, 16)
    for chain in (old, new):
        assert pool.allocate(2)
        for h in chain:
            pool.promote(h)
        pool.release(chain, 0)
    assert pool.allocate(1)  # evicts the last block of the oldest chain
    assert pool.cached_prefix(old) == 1 and pool.cached_prefix(new) == 2
    assert pool.allocate(3) and pool.cached_prefix(new) == 0
    assert not pool.allocate(1)


def test_hash_chain_depends_on_everything_before() -> None:
    a = block_hashes("x" * 64 + "y" * 64, 16)
    b = block_hashes("z" * 64 + "y" * 64, 16)
    assert len(a) == 2 and a[1] != b[1]
    assert block_hashes("x" * 127, 16) == a[:1]
