"""The tenants file: parse → validate → immutable snapshot; API keys; atomic writes."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import secrets
import tempfile
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from types import MappingProxyType

import yaml

from extauthz.types import (
    KEY_PREFIX,
    ApiKey,
    KeyEntry,
    Snapshot,
    Tenant,
    TenantsFile,
    TenantView,
)
from llmgw import wire
from llmgw.config import ConfigError, read_yaml, validate
from llmgw.tiers import TierTable


def digest(api_key: str) -> bytes:
    return hashlib.sha256(api_key.encode()).digest()


def new_key(now: datetime, expires: datetime | None = None) -> tuple[str, ApiKey]:
    """A fresh API key (returned once) and the record that stores only its hash."""
    api_key = KEY_PREFIX + secrets.token_urlsafe(32)
    record = ApiKey(
        id="key_" + secrets.token_hex(6),
        sha256=digest(api_key).hex(),
        prefix=api_key[: len(KEY_PREFIX) + 4],
        created=now,
        expires=expires,
    )
    return api_key, record


def read(path: Path) -> TenantsFile:
    """The validated file; `ConfigError` names the file and the key at fault."""
    return validate(TenantsFile, read_yaml(path), str(path))


def snapshot(data: TenantsFile, table: TierTable, source: str = "tenants file") -> Snapshot:
    """The lookup tables of a validated file; a tier the tier table lacks is a ConfigError."""
    tenants: dict[str, TenantView] = {}
    keys: dict[bytes, KeyEntry] = {}
    known = table.all_tiers
    for i, tenant in enumerate(data.tenants):
        if tenant.tier not in known:
            raise ConfigError(
                f"{source}: tenants.{i}.tier: unknown tier {tenant.tier!r} "
                f"(the tier table has {', '.join(sorted(known))})"
            )
        view = tenant_view(tenant, table)
        tenants[tenant.id] = view
        keys.update(key_entries(tenant, view))
    return Snapshot(keys=MappingProxyType(keys), tenants=MappingProxyType(tenants), tiers=table)


def tenant_view(tenant: Tenant, table: TierTable) -> TenantView:
    """The tenant as the decision reads it; its tier must be in `table`."""
    own = tenant.own()
    return TenantView(
        id=tenant.id,
        tier=tenant.tier,
        priority=tenant.priority,
        models=None if tenant.models == "*" else frozenset(tenant.models),
        headers=(
            (wire.HEADER_TENANT, tenant.id),
            (wire.HEADER_TIER, tenant.tier),
            (wire.HEADER_PRIORITY, str(tenant.priority)),
        ),
        own=own,
        cache_group=f"group/{tenant.cache_group}" if tenant.cache_group else f"tenant/{tenant.id}",
        max_output=table.all_tiers[tenant.tier].max_output_tokens,
        token_ceiling=table.token_ceiling(tenant.id, tenant.tier, own),
    )


def key_entries(tenant: Tenant, view: TenantView) -> dict[bytes, KeyEntry]:
    """The tenant's keys by digest."""
    out: dict[bytes, KeyEntry] = {}
    for key in tenant.keys:
        raw = bytes.fromhex(key.sha256)
        out[raw] = KeyEntry(
            digest=raw,
            key_id=key.id,
            tenant=view,
            expires=key.expires.timestamp() if key.expires else None,
            revoked=key.revoked,
        )
    return out


def load(path: Path, table: TierTable) -> Snapshot:
    return snapshot(read(path), table, str(path))


def write(path: Path, data: TenantsFile) -> None:
    """Replace the file atomically: readers see the old file or the new one, never half."""
    replace(
        path, yaml.safe_dump(data.model_dump(mode="json", exclude_defaults=True), sort_keys=False)
    )


def replace(path: Path, text: str) -> None:
    """Write `text` to `path` atomically, mode 0600 (mkstemp's: the file holds key hashes)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def editing(path: Path) -> Iterator[None]:
    """Serialise read-modify-write cycles of concurrent CLI runs (a lock file beside it)."""
    lock_path = path.with_name(f".{path.name}.lock")
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
