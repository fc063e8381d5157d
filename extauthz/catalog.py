"""The tenants a database source holds (extauthz/follower.py) and their snapshot, changed one
tenant at a time.

Rows are validated by the tenants file's models. A row that does not validate, or names a tier
the tier table lacks, is logged and fails closed: the tenant's keys leave the snapshot (a change
this replica cannot read, such as a move to a tier it does not know yet together with a
revocation, must never leave an old key working), and the rest loads. A tenant on an unknown
tier is kept aside, and comes back when the tier table gains its tier. A change replaces only its
tenants' entries in the snapshot's maps (extauthz/sharded.py), never copying every key.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from extauthz.sharded import Sharded
from extauthz.tenants import key_entries, tenant_view
from extauthz.types import ApiKey, KeyEntry, Snapshot, Tenant, TenantView
from llmgw.tiers import TierTable

log = logging.getLogger(__name__)

HEAD = "tenants:\n"  # the cache file's first line; one line per tenant follows (Held.line)


@dataclass(frozen=True, slots=True)
class Row:
    """A row of `tenants` with its rows of `api_keys` (admin/migrations/0001_admin.sql)."""

    id: str
    rev: int
    deleted: bool
    spec: str  # the Tenant's JSON, without keys
    keys: tuple[Mapping[str, Any], ...] = ()  # ApiKey's fields


def parse(row: Row) -> Tenant | None:
    """The row's tenant (a key row that does not validate left out, logged); None: a bad row."""
    keys: list[ApiKey] = []
    for key in row.keys:
        try:
            keys.append(ApiKey.model_validate(key))
        except ValidationError as exc:
            log.error("tenants database: key skipped", extra=_why(row, exc, key=key.get("id")))
    try:
        spec = json.loads(row.spec)
        if not isinstance(spec, dict) or "keys" in spec or spec.get("id", row.id) != row.id:
            raise ValueError("spec: a Tenant's JSON without keys, of the row's id")
        return Tenant.model_validate({**spec, "id": row.id, "keys": keys})
    except (ValueError, ValidationError) as exc:  # ValidationError is a ValueError: both named
        log.error("tenants database: tenant skipped", extra=_why(row, exc))
        return None


def _why(row: Row, exc: Exception, **more: object) -> dict[str, object]:
    return {"tenant": row.id, "rev": row.rev, "error": str(exc), **more}


@dataclass(frozen=True, slots=True)
class Held:
    digests: tuple[bytes, ...]  # its keys in the snapshot, removed when it changes
    line: str  # the tenant as a line of the cache file: a YAML flow mapping (its JSON)
    parked: bool = False  # its tier unknown: nothing in the snapshot until the table has it


@dataclass(frozen=True, slots=True)
class Catalog:
    held: Sharded[str, Held]
    keys: Sharded[bytes, KeyEntry]
    views: Sharded[str, TenantView]
    snapshot: Snapshot  # of these keys and views: what the Director reads

    @classmethod
    def build(cls, tenants: Iterable[Tenant], table: TierTable) -> Catalog:
        """Every tenant at once (start-up, the cache, a changed tier table)."""
        keys: Sharded[bytes, KeyEntry] = Sharded.of()
        views: Sharded[str, TenantView] = Sharded.of()
        empty = cls(Sharded.of(), keys, views, Snapshot(keys=keys, tenants=views, tiers=table))
        return empty.apply({t.id: t for t in tenants}, table)

    def apply(self, changes: Mapping[str, Tenant | None], table: TierTable) -> Catalog:
        """These tenants replaced (None: removed), every other entry shared with this one."""
        drop_keys: list[bytes] = []
        put_keys: dict[bytes, KeyEntry] = {}
        put_views: dict[str, TenantView] = {}
        put_held: dict[str, Held] = {}
        gone: list[str] = []
        dropped_views: list[str] = []  # parked: held, but no view
        known = table.all_tiers
        for tenant_id, tenant in changes.items():
            old = self.held.get(tenant_id)
            if old is not None:
                drop_keys.extend(old.digests)
            if tenant is None:
                gone.append(tenant_id)
                continue
            line = f"- {tenant.model_dump_json(exclude_defaults=True)}\n"
            if tenant.tier not in known:
                log.error(
                    "tenants database: tenant's keys refused: unknown tier",
                    extra={"tenant": tenant_id, "tier": tenant.tier, "tiers": sorted(known)},
                )
                put_held[tenant_id] = Held((), line, parked=True)
                dropped_views.append(tenant_id)
                continue
            view = tenant_view(tenant, table)
            entries = key_entries(tenant, view)
            put_keys.update(entries)
            put_views[tenant_id] = view
            put_held[tenant_id] = Held(tuple(entries), line)
        keys = self.keys.evolve(put_keys, drop_keys)
        views = self.views.evolve(put_views, [*gone, *dropped_views])
        snapshot = Snapshot(keys=keys, tenants=views, tiers=table)
        return Catalog(self.held.evolve(put_held, gone), keys, views, snapshot)

    def retier(self, table: TierTable) -> Catalog:
        """Every tenant again under a changed tier table (its limits and caps are in the views)."""
        tenants = (Tenant.model_validate_json(h.line[2:]) for h in self.held.values())
        return Catalog.build(tenants, table)

    def text(self) -> str:
        """The tenants file of this snapshot (hashes only: a Tenant holds no key)."""
        return HEAD + "".join(h.line for h in self.held.values())
