"""Envoy's file access log (envoy/envoy.yaml.j2, one JSON object a line) read as an `Entry`.

The file is the durable copy of what the gRPC access log sends the ledger: the same dynamic
metadata, whole namespaces, so `ledger.entry.outcome_of` makes the same outcome of either. Envoy
prints "-" for a value it does not have (a namespace no filter wrote, no upstream, no flags).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ledger.entry import Entry
from llmgw import wire

ABSENT = "-"


class Malformed(ValueError):
    """A line that is not a record of ours (cut short, or not JSON of this shape)."""


class FileRecord(BaseModel):
    """The keys the ledger reads; the log's other keys are for people."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    ts: datetime | str
    request_id: str
    path: str = ""
    status: int | str = 0
    flags: str = ABSENT
    pod: str = ABSENT
    attempts: int | str = 0
    bytes_in: int | str = 0
    bytes_out: int | str = 0
    headers_in: int | str = 0
    headers_out: int | str = 0
    duration_us: float | str = 0
    ttft_us: float | str = ABSENT
    authz: dict[str, Any] | str = Field(ABSENT, validation_alias=wire.EXTAUTHZ_NAMESPACE)
    usage: dict[str, Any] | str = Field(ABSENT, validation_alias=wire.USAGE_NAMESPACE)
    ratelimit: dict[str, Any] | str = Field(ABSENT, validation_alias=wire.RATELIMIT_NAMESPACE)


def _n(v: float | str) -> float | None:
    try:
        return float(v)
    except ValueError:
        return None


def _meta(v: dict[str, Any] | str) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


def parse(line: str | bytes) -> Entry:
    """One line of the log; raises Malformed."""
    try:
        r = FileRecord.model_validate_json(line)
    except ValidationError as exc:
        raise Malformed(str(exc.errors(include_url=False, include_input=False))) from None
    duration = _n(r.duration_us)
    ttft = _n(r.ttft_us)
    return Entry(
        request_id="" if r.request_id == ABSENT else r.request_id,
        start=r.ts if isinstance(r.ts, datetime) else None,
        status=int(_n(r.status) or 0),
        codes=[] if r.flags == ABSENT else r.flags.split(","),
        pod="" if r.pod == ABSENT else r.pod,
        attempts=int(_n(r.attempts) or 0),
        ttft_ms=None if ttft is None else ttft / 1000,
        duration_ms=(duration or 0.0) / 1000,
        path="" if r.path == ABSENT else r.path,
        bytes_in=int((_n(r.bytes_in) or 0) + (_n(r.headers_in) or 0)),
        bytes_out=int((_n(r.bytes_out) or 0) + (_n(r.headers_out) or 0)),
        authz=_meta(r.authz),
        usage=_meta(r.usage),
        ratelimit=_meta(r.ratelimit),
    )
