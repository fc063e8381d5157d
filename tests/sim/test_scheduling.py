"""The scheduler's choices, driven step by step in simulated time (no wall clock involved)."""

from __future__ import annotations

from typing import Any

import pytest

from sim.engine import Engine, Sequence
from sim.metrics import Stats
from sim.profile import PROFILES
from sim.types import Job, SchedulingPolicy, SimSettings
from sim.waiting import FcfsQueue, PriorityQueue

pytestmark = pytest.mark.timeout(30)


def engine(policy: SchedulingPolicy, **fields: Any) -> Engine:
    settings = SimSettings(port=0, time_scale=1e-6, scheduling_policy=policy, **fields)
    return Engine(settings, PROFILES["h100-llama-8b"], Stats())


def job(name: str, priority: int, prompt_tokens: int = 40, output: int = 20) -> Job:
    prompt = name * (4 * prompt_tokens // len(name))
    return Job(prompt, prompt_tokens, output, "length", priority=priority)


async def submit(e: Engine, j: Job) -> Sequence:
    return (await e.submit([j]))[0]


def run(e: Engine) -> None:
    for _ in range(10_000):
        if not e.step():
            return
    raise AssertionError("the engine did not drain")


def served_order(*seqs: Sequence) -> list[str]:
    """Sequences by the simulated time of their last token."""
    return [s.job.prompt[0] for s in sorted(seqs, key=lambda s: s.last_token)]


@pytest.mark.parametrize(("policy", "order"), [("fcfs", "abc"), ("priority", "acb")])
async def test_waiting_queue_order(policy: SchedulingPolicy, order: str) -> None:
    e = engine(policy, max_num_seqs=1)
    a = await submit(e, job("a", priority=9))
    assert e.step() and a in e.running
    b = await submit(e, job("b", priority=5))
    c = await submit(e, job("c", priority=1))  # arrives later, more urgent (lower)
    e.step()
    assert a in e.running and a.preemptions == 0  # a waiting request never preempts by itself
    run(e)
    assert "".join(served_order(a, b, c)) == order
    assert all(s.done for s in (a, b, c))


@pytest.mark.parametrize(("policy", "victim"), [("fcfs", "b"), ("priority", "a")])
async def test_preemption_victim(policy: SchedulingPolicy, victim: str) -> None:
    # 12 blocks of 16 tokens: two sequences growing to 40 + 120 tokens cannot both stay.
    e = engine(policy, num_gpu_blocks=12, block_size=16)
    a = await submit(e, job("a", priority=5, output=120))
    assert e.step()
    b = await submit(e, job("b", priority=1, output=120))  # newest, but more urgent
    while a.preemptions + b.preemptions == 0:
        assert e.step()
    preempted = "a" if a.preemptions else "b"
    assert preempted == victim  # fcfs: the newest; priority: the largest (priority, arrival)
    run(e)
    assert a.done and b.done and e.gauges() == (0, 0, 0.0)


async def test_a_waiting_request_is_admitted_only_if_its_whole_prompt_fits() -> None:
    # 10 blocks; a holds 7 (100 prompt tokens + output); b's first 32-token chunk would fit
    # in the 3 left, its 100-token prompt would not: it waits instead of thrashing.
    e = engine("fcfs", num_gpu_blocks=10, block_size=16, max_num_batched_tokens=32)
    a = await submit(e, job("a", priority=0, prompt_tokens=100, output=8))
    while a.first_token is None:
        assert e.step()
    b = await submit(e, job("b", priority=0, prompt_tokens=100, output=8))
    while not a.done:
        assert e.step()
        assert b.computed == 0 or a.done
    run(e)
    assert b.done and e.stats.preemptions == 0


def test_priority_queue_breaks_ties_by_arrival_and_requeues_by_priority() -> None:
    class Item:
        def __init__(self, priority: int, arrival: float) -> None:
            self.priority, self.arrival = priority, arrival

    late, early, urgent = Item(1, 2.0), Item(1, 1.0), Item(0, 3.0)
    heap: PriorityQueue[Item] = PriorityQueue()
    for item in (late, early, urgent):
        heap.add(item)
    assert heap.pop() is urgent
    heap.prepend(urgent)  # a preempted request gets no front seat, its priority decides
    assert [heap.pop(), heap.pop(), heap.pop()] == [urgent, early, late]
    fifo: FcfsQueue[Item] = FcfsQueue()
    fifo.add(late)
    fifo.add(urgent)
    fifo.prepend(early)
    assert [fifo.pop(), fifo.pop(), fifo.pop()] == [early, late, urgent]
