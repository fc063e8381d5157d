"""The tenants, their keys and the audit in PostgreSQL (admin/migrations/0001_admin.sql).

Every change is one transaction: the row change, the tenant's new revision (`rev` from the
sequence, `updated`), `pg_notify('llmgw_tenants', rev)` (delivered at commit: a follower that
hears it reads `WHERE rev > $last`) and an audit row. A key's secret is never stored (its
SHA-256 is): `create_key` and `rotate_key` return it, once; no answer, audit row or log line
holds the secret or the hash.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg

from admin import metrics
from admin.specs import changed_tenant, spec_of
from admin.types import ApiError, KeyRow, Page, PageRequest, TenantRow
from extauthz.tenants import new_key
from extauthz.types import ApiKey, Tenant
from llmgw import wire
from llmgw.tiers import TierTable

log = logging.getLogger(__name__)

ACTOR = "admin-token"  # who changed it: the one admin token (OIDC subjects later)
KEY_COLUMNS = "id, tenant, sha256, prefix, created, expires, revoked"
TENANT_COLUMNS = "id, spec, rev, deleted, updated"


async def init_connection(conn: Any) -> None:
    """jsonb as Python values both ways."""
    await conn.set_type_codec(
        "jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog", format="text"
    )


def _tenant(r: Mapping[str, Any]) -> TenantRow:
    return TenantRow(Tenant.model_validate(r["spec"]), r["rev"], r["deleted"], r["updated"])


def _key(r: Mapping[str, Any]) -> KeyRow:
    fields = ("id", "sha256", "prefix", "created", "expires", "revoked")
    return KeyRow(r["tenant"], ApiKey.model_validate({f: r[f] for f in fields}))


@dataclass(frozen=True)
class Change:
    action: str
    target: str
    tenant: str
    rev: int

    def report(self) -> None:
        """A log line and a count, for a change committed."""
        metrics.CHANGES.labels(self.action).inc()
        log.info("changed", extra=asdict(self))


class Store:
    def __init__(
        self,
        pool: Any,  # asyncpg.Pool
        tiers: Callable[[], TierTable],
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.pool = pool
        self.tiers = tiers
        self.clock = clock

    async def ping(self) -> None:
        await self.pool.fetchval("SELECT 1")

    # Tenants.

    async def tenant(self, tenant_id: str) -> TenantRow:
        row = await self.pool.fetchrow(
            f"SELECT {TENANT_COLUMNS} FROM tenants WHERE id = $1 AND NOT deleted", tenant_id
        )
        if row is None:
            raise ApiError.not_found("tenant", tenant_id)
        return _tenant(row)

    async def tenants(self, page: PageRequest) -> Page[TenantRow]:
        rows = await self.pool.fetch(
            f"SELECT {TENANT_COLUMNS} FROM tenants WHERE NOT deleted"
            " AND ($1::text IS NULL OR id > $1) ORDER BY id LIMIT $2",
            page.after,
            page.limit + 1,
        )
        return Page.of([_tenant(r) for r in rows], page.limit, lambda t: t.spec.id)

    async def create_tenant(self, spec: Tenant) -> TenantRow:
        """A new tenant, or one deleted before made anew (its old keys stay revoked)."""
        async with self.pool.acquire() as conn, conn.transaction():
            made = await conn.fetchval(
                "INSERT INTO tenants (id, spec) VALUES ($1, $2) ON CONFLICT (id) DO UPDATE"
                " SET spec = EXCLUDED.spec, deleted = false WHERE tenants.deleted RETURNING id",
                spec.id,
                spec_of(spec),
            )
            if made is None:
                raise ApiError.conflict(f"tenant {spec.id!r} exists", "id")
            detail = {"spec": spec_of(spec)}
            done = await self._changed(conn, spec.id, "tenant.create", spec.id, detail)
            row = await self._row(conn, spec.id)
        done.report()
        return row

    async def update_tenant(self, tenant_id: str, body: object) -> TenantRow:
        """The fields `body` names replaced (admin/specs.py), under the row's lock."""
        async with self.pool.acquire() as conn, conn.transaction():
            record = await conn.fetchrow(
                f"SELECT {TENANT_COLUMNS} FROM tenants WHERE id = $1 AND NOT deleted FOR UPDATE",
                tenant_id,
            )
            if record is None:
                raise ApiError.not_found("tenant", tenant_id)
            current = _tenant(record)
            before = spec_of(current.spec)
            after = spec_of(changed_tenant(current.spec, body, self.tiers()))
            if after == before:  # nothing changed: no revision, no notification
                return current
            await conn.execute("UPDATE tenants SET spec = $2 WHERE id = $1", tenant_id, after)
            detail = {"changed": sorted(k for k in after if after[k] != before.get(k))}
            done = await self._changed(conn, tenant_id, "tenant.update", tenant_id, detail)
            row = await self._row(conn, tenant_id)
        done.report()
        return row

    async def delete_tenant(self, tenant_id: str) -> TenantRow:
        """A tombstone (followers learn the tenant went), every key of it revoked."""
        async with self.pool.acquire() as conn, conn.transaction():
            found = await conn.fetchval(
                "UPDATE tenants SET deleted = true WHERE id = $1 AND NOT deleted RETURNING id",
                tenant_id,
            )
            if found is None:
                raise ApiError.not_found("tenant", tenant_id)
            revoked = await conn.fetch(
                "UPDATE api_keys SET revoked = true WHERE tenant = $1 AND NOT revoked RETURNING id",
                tenant_id,
            )
            detail = {"revoked_keys": sorted(r["id"] for r in revoked)}
            done = await self._changed(conn, tenant_id, "tenant.delete", tenant_id, detail)
            row = await self._row(conn, tenant_id)
        done.report()
        return row

    # Keys.

    async def keys(self, tenant_id: str, page: PageRequest) -> Page[KeyRow]:
        await self.tenant(tenant_id)  # 404 for a tenant unknown or deleted
        rows = await self.pool.fetch(
            f"SELECT {KEY_COLUMNS} FROM api_keys WHERE tenant = $1"
            " AND ($2::text IS NULL OR id > $2) ORDER BY id LIMIT $3",
            tenant_id,
            page.after,
            page.limit + 1,
        )
        return Page.of([_key(r) for r in rows], page.limit, lambda k: k.key.id)

    async def create_key(self, tenant_id: str, expires: datetime | None) -> tuple[str, KeyRow]:
        """A new key of the tenant: the secret (returned this once) and its row."""
        now = self.clock()
        if expires is not None and expires <= now:
            raise ApiError.invalid("expires_at", "must be in the future")
        async with self.pool.acquire() as conn, conn.transaction():
            live = await conn.fetchval(
                "SELECT id FROM tenants WHERE id = $1 AND NOT deleted FOR UPDATE", tenant_id
            )
            if live is None:
                raise ApiError.not_found("tenant", tenant_id)
            secret, key = new_key(now, expires)
            await self._insert_key(conn, tenant_id, key)
            detail = {"tenant": tenant_id, "expires": key.expires}
            done = await self._changed(conn, tenant_id, "key.create", key.id, detail)
        done.report()
        return secret, KeyRow(tenant_id, key)

    async def revoke_key(self, key_id: str) -> KeyRow:
        async with self.pool.acquire() as conn, conn.transaction():
            old = await self._locked_key(conn, key_id)
            if old.key.revoked:  # already: nothing changes
                return old
            await conn.execute("UPDATE api_keys SET revoked = true WHERE id = $1", key_id)
            detail = {"tenant": old.tenant}
            done = await self._changed(conn, old.tenant, "key.revoke", key_id, detail)
        done.report()
        return KeyRow(old.tenant, old.key.model_copy(update={"revoked": True}))

    async def rotate_key(self, key_id: str, overlap_s: float) -> tuple[str, KeyRow, KeyRow]:
        """A new key for the old one's tenant; the old one works `overlap_s` more (or until its
        own expiry, if sooner). Returns the new secret (this once), the new key, the old key."""
        now = self.clock()
        async with self.pool.acquire() as conn, conn.transaction():
            old = await self._locked_key(conn, key_id)
            if old.key.revoked:
                raise ApiError.conflict(f"key {key_id!r} is revoked: create a new key instead")
            if old.key.expires is not None and old.key.expires <= now:
                raise ApiError.conflict(f"key {key_id!r} has expired: create a new key instead")
            until = now + timedelta(seconds=overlap_s)
            if old.key.expires is not None:
                until = min(until, old.key.expires)
            # The new key lives as long as the old one was to (a rotation is no extension).
            secret, key = new_key(now, old.key.expires)
            await self._insert_key(conn, old.tenant, key)
            await conn.execute("UPDATE api_keys SET expires = $2 WHERE id = $1", key_id, until)
            detail = {"tenant": old.tenant, "new_key": key.id, "old_expires": until}
            done = await self._changed(conn, old.tenant, "key.rotate", key_id, detail)
        done.report()
        old_key = old.key.model_copy(update={"expires": until})
        return secret, KeyRow(old.tenant, key), KeyRow(old.tenant, old_key)

    # The audit.

    async def audit(self, page: PageRequest) -> Page[dict[str, Any]]:
        rows = await self.pool.fetch(
            "SELECT id, at, actor, action, target, detail FROM audit"
            " WHERE ($1::bigint IS NULL OR id > $1) ORDER BY id LIMIT $2",
            None if page.after is None else int(page.after),
            page.limit + 1,
        )
        return Page.of([dict(r) for r in rows], page.limit, lambda r: r["id"])

    # Import.

    async def import_tenants(self, tenants: Sequence[Tenant]) -> list[str]:
        """The tenants of a tenants file into the database: each spec replaces the database's,
        each key the database lacks is added (by its hash: the file holds no secret), a key the
        file revoked or expires sooner is revoked or expires in the database too (never the
        other way), and the keys an earlier import added that the file no longer has are
        revoked (an old run's demo keys, printed in an old banner, stop; keys made through the
        API stay). A tenant deleted through the API stays deleted. Returns the tenants that
        changed."""
        changed: list[str] = []
        for t in tenants:
            done = None
            async with self.pool.acquire() as conn, conn.transaction():
                if await conn.fetchval("SELECT deleted FROM tenants WHERE id = $1", t.id):
                    continue  # deleted through the API: the operator's word is the last
                spec = await conn.fetchval(
                    "INSERT INTO tenants (id, spec) VALUES ($1, $2) ON CONFLICT (id) DO UPDATE"
                    " SET spec = EXCLUDED.spec WHERE tenants.spec IS DISTINCT FROM EXCLUDED.spec"
                    " RETURNING id",
                    t.id,
                    spec_of(t),
                )
                added = [k.id for k in t.keys if await self._insert_key(conn, t.id, k, quiet=True)]
                tightened = await conn.fetch(
                    "UPDATE api_keys AS k SET revoked = k.revoked OR f.revoked,"
                    " expires = CASE WHEN f.expires IS NOT NULL AND (k.expires IS NULL"
                    " OR f.expires < k.expires) THEN f.expires ELSE k.expires END"
                    " FROM unnest($2::text[], $3::bool[], $4::timestamptz[])"
                    " AS f(id, revoked, expires)"
                    " WHERE k.id = f.id AND k.tenant = $1 AND ((f.revoked AND NOT k.revoked)"
                    " OR (f.expires IS NOT NULL AND (k.expires IS NULL OR f.expires < k.expires)))"
                    " RETURNING k.id",
                    t.id,
                    [k.id for k in t.keys],
                    [k.revoked for k in t.keys],
                    [k.expires for k in t.keys],
                )
                gone = await conn.fetch(
                    "UPDATE api_keys SET revoked = true WHERE tenant = $1 AND NOT revoked"
                    " AND NOT (id = ANY($2::text[])) AND id IN (SELECT"
                    " jsonb_array_elements_text(detail->'keys_added') FROM audit"
                    " WHERE action = 'tenant.import' AND target = $1) RETURNING id",
                    t.id,
                    [k.id for k in t.keys],
                )
                revoked = [r["id"] for r in gone]
                narrowed = [r["id"] for r in tightened]
                if spec is not None or added or revoked or narrowed:
                    detail = {
                        "keys_added": added,
                        "keys_revoked": revoked,
                        "keys_narrowed": narrowed,
                    }
                    done = await self._changed(conn, t.id, "tenant.import", t.id, detail)
            if done is not None:
                done.report()
                changed.append(t.id)
        return changed

    # Helpers.

    async def _row(self, conn: Any, tenant_id: str) -> TenantRow:
        """The tenant as `conn`'s transaction sees it (tombstones too)."""
        return _tenant(
            await conn.fetchrow(f"SELECT {TENANT_COLUMNS} FROM tenants WHERE id = $1", tenant_id)
        )

    async def _locked_key(self, conn: Any, key_id: str) -> KeyRow:
        row = await conn.fetchrow(
            f"SELECT {KEY_COLUMNS} FROM api_keys WHERE id = $1 FOR UPDATE", key_id
        )
        if row is None:
            raise ApiError.not_found("key", key_id)
        return _key(row)

    async def _insert_key(self, conn: Any, tenant: str, key: ApiKey, quiet: bool = False) -> bool:
        """Insert the key's row; `quiet`: one already there (by ID or hash) is left, False."""
        inserted = await conn.fetchval(
            f"INSERT INTO api_keys ({KEY_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7)"
            + (" ON CONFLICT DO NOTHING" if quiet else "")
            + " RETURNING id",
            key.id,
            tenant,
            key.sha256,
            key.prefix,
            key.created,
            key.expires,
            key.revoked,
        )
        return inserted is not None

    async def _changed(
        self, conn: Any, tenant: str, action: str, target: str, detail: Mapping[str, Any]
    ) -> Change:
        """The tenant's new revision, its notification and the audit row, in `conn`'s
        transaction (reported once it commits). `detail` never holds a key or a hash."""
        rev = await conn.fetchval(
            "UPDATE tenants SET rev = nextval('tenant_revisions'), updated = now()"
            " WHERE id = $1 RETURNING rev",
            tenant,
        )
        await conn.execute("SELECT pg_notify($1, $2)", wire.TENANTS_CHANNEL, str(rev))
        await conn.execute(
            "INSERT INTO audit (actor, action, target, detail) VALUES ($1, $2, $3, $4)",
            ACTOR,
            action,
            target,
            json.loads(json.dumps(detail, default=str)),  # datetimes as text
        )
        return Change(action, target, tenant, rev)


def is_database_error(exc: BaseException) -> bool:
    """The database down or failing, not the request (a 503: `database_error`)."""
    return isinstance(exc, OSError | asyncpg.PostgresError | asyncpg.InterfaceError | TimeoutError)


def database_error(exc: BaseException) -> ApiError | None:
    """The answer to a request the database refused: a value it cannot hold or compare (a NUL, a
    lone surrogate, a date out of its range) is the request's fault; a deadlock or serialization
    failure a conflict to retry; anything else of the database's, its being down. None: not the
    database's."""
    if isinstance(exc, asyncpg.DataError | UnicodeEncodeError):
        return ApiError(400, "a value the database cannot store or compare", "invalid_value")
    if isinstance(exc, asyncpg.DeadlockDetectedError | asyncpg.SerializationError):
        return ApiError.conflict("a concurrent change: retry")
    if is_database_error(exc):
        return ApiError(503, "database unavailable", "unavailable", type="server_error")
    return None
