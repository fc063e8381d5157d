"""Saturation, the one definition: when a pod has no room for one more request, and which pods of
a model's fleet have seats free. The not-saturated filter (router/plugins/not_saturated.py) keeps
the pods below `Bounds`; flow control (extauthz/flow.py) holds requests while no pod serving
their model has a seat.

A pod's seats are its capacity's whole part (max_num_seqs, as configured: router/fleet.py
`capacity_of`). Its free seats: capacity − running − waiting − the picks its latest scrape cannot
show yet (made after it, or shortly before it and not among the arrivals its counts show) + the
requests whose outcomes arrived since it (ended: their seats free before the next scrape shows
it); none when its waiting queue or KV-cache usage is at `Bounds`.
A pod whose scrape is late is unknown, not saturated: its seats count as free, less the picks
made since its last scrape, so that one slow scrape neither queues every request nor lets the
queue flush into that pod. A pod that is down (its last scrape failed, or in its health's
cooldown) has no seats.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmgw.config import Strict
from router.fleet import Fleet
from router.types import Candidate, PodId


class Bounds(Strict):
    kv_max: float = 0.95  # KV-cache usage at or above this is saturated
    queue_max: float = 8.0  # waiting requests at or above this is saturated

    def saturated(self, c: Candidate) -> bool:
        """Stale metrics count as saturated (Candidate: KV 1, queue at capacity)."""
        return not c.fresh or c.kv >= self.kv_max or c.queue >= self.queue_max


@dataclass(frozen=True, slots=True)
class Seats:
    """A model's fleet as flow control sees it: each usable pod's free seats (only pods with
    one), and the seats of every usable pod serving it."""

    free: dict[PodId, int]
    total: int

    @property
    def free_total(self) -> int:
        return sum(self.free.values())


def seats(fleet: Fleet, bounds: Bounds, model: str | None) -> Seats:
    """The seats of the pods serving `model` (None, or a pod whose models are not known yet:
    any pod)."""
    free: dict[PodId, int] = {}
    total = 0
    for c in fleet.candidates():
        m = c.metrics
        if not c.healthy or (model is not None and m.models and model not in m.models):
            continue
        whole = int(c.capacity)  # a pod of capacity 1.5 runs one request, not 1.5
        total += whole
        if not c.fresh:
            room = whole - max(0, fleet.unseen(c.pod))
        elif c.kv >= bounds.kv_max or c.queue >= bounds.queue_max:
            continue
        else:
            room = int(c.capacity - m.running - m.waiting) - fleet.unseen(c.pod)
        if room > 0:
            free[c.pod] = room
    return Seats(free, total)
