"""Demo tenants, one per built-in tier, for `llmgw up`."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from extauthz import tenants
from extauthz.types import Tenant, TenantsFile

DEMO = (
    ("demo-free", "free", 2),
    ("demo-standard", "standard", 5),
    ("demo-platinum", "platinum", 9),
)


def seed_demo(path: Path) -> list[dict[str, str]]:
    """Write (or refresh) the demo tenants with one fresh key each; other tenants are kept.

    Returns [{"id", "tier", "api_key"}]: the only place the keys appear in clear.
    """
    with tenants.editing(path):
        data = tenants.read(path) if path.exists() else TenantsFile()
        now = datetime.now(UTC).replace(microsecond=0)
        demo_ids = {tenant_id for tenant_id, _, _ in DEMO}
        kept = [t for t in data.tenants if t.id not in demo_ids]
        seeded: list[dict[str, str]] = []
        for tenant_id, tier, priority in DEMO:
            api_key, record = tenants.new_key(now)
            kept.append(
                Tenant(
                    id=tenant_id,
                    name=f"Demo ({tier})",
                    tier=tier,
                    priority=priority,
                    models="*",
                    keys=(record,),
                )
            )
            seeded.append({"id": tenant_id, "tier": tier, "api_key": api_key})
        tenants.write(path, TenantsFile(tenants=tuple(kept)))
    return seeded
