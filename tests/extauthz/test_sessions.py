from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extauthz.sessions import (
    EPOCH_MS,
    LENGTH,
    MAX_WORKER,
    PREFIX,
    SessionCodec,
    Sessions,
    Snowflake,
    id_time_ms,
)
from tests.extauthz.conftest import SECRET

T0 = EPOCH_MS + 500 * 86_400_000  # some day in 2025
CODEC = SessionCodec(SECRET)
ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


def clock(n: int, seed: int) -> np.ndarray:
    """Milliseconds at ~4 IDs per ms, stepping back 5 s twice and frozen for 10,000 IDs."""
    rng = np.random.default_rng(seed)
    steps = rng.choice([0, 0, 0, 1, 2], size=n)
    steps[n // 3] = -5_000
    steps[2 * n // 3] = -5_000
    steps[n // 2 : n // 2 + 10_000] = 0  # frozen: 10,000 IDs in one ms overflow the sequence
    return T0 + np.cumsum(steps)


def test_a_million_ids_from_four_workers() -> None:
    per_worker = 250_000
    batches = []
    for worker in (0, 1, 7, MAX_WORKER):
        gen = Snowflake(worker)
        now = clock(per_worker, seed=worker).tolist()
        ids = np.fromiter((gen.next_id(t) for t in now), dtype=np.uint64, count=per_worker)
        assert np.all(ids[1:] > ids[:-1]), f"worker {worker} not strictly increasing"
        assert np.all((ids >> np.uint64(12)) & np.uint64(MAX_WORKER) == worker)
        batches.append(ids)
    every = np.concatenate(batches)
    assert every.size == 1_000_000
    assert np.unique(every).size == every.size
    assert int(every.max()) < 1 << 63


def test_clock_backwards_reuses_the_last_millisecond() -> None:
    gen = Snowflake(3)
    a = gen.next_id(T0)
    b = gen.next_id(T0 - 60_000)
    c = gen.next_id(T0 + 1)
    assert a < b < c
    assert id_time_ms(a) == id_time_ms(b) == T0
    assert id_time_ms(c) == T0 + 1


def test_sequence_overflow_borrows_the_next_millisecond() -> None:
    gen = Snowflake(0)
    ids = [gen.next_id(T0) for _ in range(4097)]
    assert id_time_ms(ids[-2]) == T0
    assert id_time_ms(ids[-1]) == T0 + 1
    assert ids == sorted(set(ids))


def test_worker_id_is_range_checked() -> None:
    with pytest.raises(ValueError):
        Snowflake(MAX_WORKER + 1)


def test_roundtrip_and_format() -> None:
    sid = Snowflake(5).next_id(T0)
    text = CODEC.encode("acme", sid)
    assert text.startswith(PREFIX)
    assert len(text) == LENGTH
    assert CODEC.decode("acme", text, T0) == sid


def test_every_single_character_mutation_is_rejected() -> None:
    text = CODEC.encode("acme", Snowflake(1).next_id(T0))
    mutations = 0
    for i in range(len(PREFIX), len(text)):
        for char in ALPHABET:
            if char != text[i]:
                assert CODEC.decode("acme", text[:i] + char + text[i + 1 :], T0) is None
                mutations += 1
    assert mutations > 1500


@settings(max_examples=1000, deadline=None, database=None)
@given(
    tenant=st.text(min_size=1, max_size=20),
    other=st.text(min_size=1, max_size=20),
    worker=st.integers(0, MAX_WORKER),
    offset=st.integers(0, 10**9),
)
def test_cross_tenant_ids_are_rejected(tenant: str, other: str, worker: int, offset: int) -> None:
    text = CODEC.encode(tenant, Snowflake(worker).next_id(T0 + offset))
    if other != tenant:
        assert CODEC.decode(other, text, T0) is None
    assert CODEC.decode(tenant, text, T0 + offset) is not None


@settings(max_examples=1000, deadline=None, database=None)
@given(data=st.data())
def test_mutated_ids_are_rejected(data: st.DataObject) -> None:
    text = CODEC.encode("acme", Snowflake(2).next_id(T0))
    edit = data.draw(st.sampled_from(["replace", "insert", "delete", "case", "random"]))
    i = data.draw(st.integers(0, len(text) - 1))
    if edit == "replace":
        mutated = (
            text[:i] + data.draw(st.characters().filter(lambda c: c != text[i])) + text[i + 1 :]
        )
    elif edit == "insert":
        mutated = text[:i] + data.draw(st.characters()) + text[i:]
    elif edit == "delete":
        mutated = text[:i] + text[i + 1 :]
    elif edit == "case":
        mutated = text.swapcase()
    else:
        mutated = data.draw(st.text(max_size=40).filter(lambda t: t != text))
    assert CODEC.decode("acme", mutated, T0) is None


def test_previous_secret_verifies_during_rotation() -> None:
    old = SessionCodec(SECRET)
    rotated = SessionCodec(b"n" * 32, previous=SECRET)
    sid = Snowflake(1).next_id(T0)
    assert rotated.decode("acme", old.encode("acme", sid), T0) == sid
    assert rotated.decode("acme", rotated.encode("acme", sid), T0) == sid
    assert SessionCodec(b"n" * 32).decode("acme", old.encode("acme", sid), T0) is None


def test_max_age() -> None:
    sessions = Sessions(SessionCodec(SECRET, max_age_ms=60_000), worker_id=0)
    text = sessions.mint("acme", T0)
    assert sessions.verify("acme", text, T0 + 60_000)
    assert not sessions.verify("acme", text, T0 + 60_001)
