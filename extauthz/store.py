"""The live tenants snapshot: the tenants file checked against the tier table, both reloaded
while running (llmgw/reload.py: parse → validate → swap, the last good snapshot kept).

The process's only load of the tier table: the snapshot carries it, and the rate limiter this
process holds reads it from there, so a tenant moved onto a new tier is never decided by a
table that lacks it (the default tier's limits)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from extauthz import metrics, tenants
from extauthz.types import Snapshot
from llmgw.reload import Reloading
from llmgw.tiers import load_tiers

TenantsStore = Reloading[Snapshot]


class TenantsSource(Protocol):
    """What the Director and the limiter read the snapshot from: the tenants file (TenantsStore)
    or the database (extauthz/follower.py TenantsFollower). Read `current` once per request."""

    @property
    def current(self) -> Snapshot: ...


def tenants_store(tenants_file: Path, tiers_file: Path | None = None) -> TenantsStore:
    def load(_: Snapshot | None) -> Snapshot:
        snapshot = tenants.load(tenants_file, load_tiers(tiers_file))
        metrics.TENANTS.set(len(snapshot.tenants))
        return snapshot

    return Reloading("tenants", [tenants_file, *([tiers_file] if tiers_file else [])], load)
