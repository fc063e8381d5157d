"""`llmgw tenants …` and `llmgw keys …`: edit the tenants file; running services reload it.

`register(subparsers)` adds the commands to the `llmgw` parser; each sets `func(args) -> int`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

from extauthz import tenants
from extauthz.types import Tenant, TenantsFile
from llmgw import wire
from llmgw.config import ConfigError, validate

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def default_path() -> Path:
    return Path(os.environ.get("LLMGW_TENANTS_FILE", "tenants.yaml"))


def duration(text: str) -> timedelta:
    """`30d`, `12h`, `90m`, `2w`, `45s`."""
    match = re.fullmatch(r"(\d+)([smhdw])", text.strip())
    if not match or int(match[1]) == 0:
        raise argparse.ArgumentTypeError(f"not a duration like 30d, 12h or 90m: {text!r}")
    return timedelta(seconds=int(match[1]) * _UNITS[match[2]])


def _tenants_list(args: argparse.Namespace) -> int:
    data = tenants.read(args.tenants_file)
    print(f"{'TENANT':<24} {'TIER':<12} {'PRIO':>4} {'KEYS':>4}  {'MODELS':<30} NAME")
    for t in data.tenants:
        models = t.models if t.models == "*" else ",".join(t.models)
        active = sum(not k.revoked for k in t.keys)
        print(f"{t.id:<24} {t.tier:<12} {t.priority:>4} {active:>4}  {models:<30} {t.name}")
    return 0


def _not_owned_by_an_admin_api(path: Path) -> None:
    """Refuse to edit the tenants file of a running `llmgw up` whose admin API owns its tenants
    (its ready file, beside the file, names the API): extauthz follows PostgreSQL there, and the
    file is read only at the next start, so a key revoked here would keep working."""
    try:
        ready = json.loads((path.resolve().parent / wire.READY_FILE).read_text())
    except (OSError, ValueError):
        return
    url = ready.get("admin_url") if isinstance(ready, dict) else None
    if isinstance(url, str):
        raise ConfigError(
            f"{path}: the stack running from here keeps its tenants in PostgreSQL: make and revoke "
            f"keys through its admin API ({url}/admin/v1/) or console ({url}/console/), or start "
            "it with --no-admin-api to use this file"
        )


def _keys_create(args: argparse.Namespace) -> int:
    _not_owned_by_an_admin_api(args.tenants_file)
    with tenants.editing(args.tenants_file):
        data = tenants.read(args.tenants_file)
        now = datetime.now(UTC).replace(microsecond=0)
        expires = now + args.expires if args.expires else None
        api_key, record = tenants.new_key(now, expires)
        updated: list[Tenant] = []
        for t in data.tenants:
            if t.id == args.tenant:
                t = t.model_copy(update={"keys": (*t.keys, record)})
            updated.append(t)
        if all(t.id != args.tenant for t in data.tenants):
            raise ConfigError(f"{args.tenants_file}: no tenant {args.tenant!r}")
        tenants.write(args.tenants_file, _revalidated(data, tuple(updated)))
    print(f"created {record.id} for {args.tenant}; the key is shown only once:", file=sys.stderr)
    print(api_key)
    return 0


def _keys_revoke(args: argparse.Namespace) -> int:
    _not_owned_by_an_admin_api(args.tenants_file)
    with tenants.editing(args.tenants_file):
        data = tenants.read(args.tenants_file)
        found = False
        updated: list[Tenant] = []
        for t in data.tenants:
            keys = tuple(
                k.model_copy(update={"revoked": True}) if k.id == args.key_id else k for k in t.keys
            )
            found = found or any(k.id == args.key_id for k in t.keys)
            updated.append(t.model_copy(update={"keys": keys}))
        if not found:
            raise ConfigError(f"{args.tenants_file}: no key {args.key_id!r}")
        tenants.write(args.tenants_file, _revalidated(data, tuple(updated)))
    print(f"revoked {args.key_id}", file=sys.stderr)
    return 0


def _keys_list(args: argparse.Namespace) -> int:
    data = tenants.read(args.tenants_file)
    matching = [t for t in data.tenants if t.id == args.tenant]
    if not matching:
        raise ConfigError(f"{args.tenants_file}: no tenant {args.tenant!r}")
    print(f"{'KEY ID':<18} {'PREFIX':<16} {'CREATED':<26} {'EXPIRES':<26} STATE")
    now = datetime.now(UTC)
    for k in matching[0].keys:
        state = (
            "revoked" if k.revoked else "expired" if k.expires and k.expires <= now else "active"
        )
        expires = k.expires.isoformat() if k.expires else "never"
        print(f"{k.id:<18} {k.prefix + '…':<16} {k.created.isoformat():<26} {expires:<26} {state}")
    return 0


def _revalidated(data: TenantsFile, updated: tuple[Tenant, ...]) -> TenantsFile:
    """The file with new tenants, through the full schema again (model_copy skips validation)."""
    raw = data.model_dump(mode="json")
    raw["tenants"] = [t.model_dump(mode="json") for t in updated]
    return validate(TenantsFile, raw, "updated tenants")


Command = Callable[[argparse.Namespace], int]


def _run(func: Command) -> Command:
    def wrapped(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1

    return wrapped


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    file_opt = argparse.ArgumentParser(add_help=False)
    file_opt.add_argument(
        "--tenants-file",
        type=Path,
        default=default_path(),
        help="tenants YAML (default: $LLMGW_TENANTS_FILE or tenants.yaml)",
    )

    tenants_cmd = subparsers.add_parser("tenants", help="tenants in the tenants file")
    tenants_sub = tenants_cmd.add_subparsers(dest="action", required=True)
    tenants_sub.add_parser("list", parents=[file_opt], help="list tenants").set_defaults(
        func=_run(_tenants_list)
    )

    keys_cmd = subparsers.add_parser("keys", help="API keys of tenants")
    keys_sub = keys_cmd.add_subparsers(dest="action", required=True)
    create = keys_sub.add_parser("create", parents=[file_opt], help="create a key (printed once)")
    create.add_argument("--tenant", required=True)
    create.add_argument("--expires", type=duration, help="lifetime, e.g. 30d, 12h")
    create.set_defaults(func=_run(_keys_create))
    revoke = keys_sub.add_parser("revoke", parents=[file_opt], help="revoke a key by its ID")
    revoke.add_argument("key_id", metavar="KEY_ID")
    revoke.set_defaults(func=_run(_keys_revoke))
    listing = keys_sub.add_parser("list", parents=[file_opt], help="key IDs and prefixes")
    listing.add_argument("--tenant", required=True)
    listing.set_defaults(func=_run(_keys_list))
