"""Envoy's file access log (envoy/envoy.yaml.j2, one JSON object a line) read as an `Entry`.

The file is the durable copy of what the gRPC access log sends the ledger: the same dynamic
metadata, whole namespaces, so `ledger.entry.outcome_of` makes the same outcome of either. Envoy
prints null for a value it does not have (a namespace no filter wrote, no upstream), "-" for no
flags.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ledger.entry import Entry
from llmgw import wire

NO_FLAGS = "-"


class Malformed(ValueError):
    """A line that is not a record of ours (cut short, or not JSON of this shape)."""


class FileRecord(BaseModel):
    """The keys the ledger reads; the log's other keys are for people."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    ts: datetime | None = None
    request_id: str | None = None
    path: str | None = None
    status: int | None = None
    flags: str | None = None
    pod: str | None = None
    attempts: int | None = None
    bytes_in: int | None = None
    bytes_out: int | None = None
    headers_in: int | None = None
    headers_out: int | None = None
    duration_us: float | None = None
    ttft_us: float | None = None
    authz: dict[str, Any] | None = Field(None, validation_alias=wire.EXTAUTHZ_NAMESPACE)
    usage: dict[str, Any] | None = Field(None, validation_alias=wire.USAGE_NAMESPACE)
    ratelimit: dict[str, Any] | None = Field(None, validation_alias=wire.RATELIMIT_NAMESPACE)


def parse(line: str | bytes) -> Entry:
    """One line of the log; raises Malformed."""
    try:
        r = FileRecord.model_validate_json(line)
    except ValidationError as exc:
        raise Malformed(str(exc.errors(include_url=False, include_input=False))) from None
    return Entry(
        request_id=r.request_id or "",
        start=r.ts,
        status=r.status or 0,
        codes=[] if r.flags in (None, NO_FLAGS) else r.flags.split(","),
        pod=r.pod or "",
        attempts=r.attempts or 0,
        ttft_ms=None if r.ttft_us is None else r.ttft_us / 1000,
        duration_ms=(r.duration_us or 0) / 1000,
        path=r.path or "",
        bytes_in=(r.bytes_in or 0) + (r.headers_in or 0),
        bytes_out=(r.bytes_out or 0) + (r.headers_out or 0),
        authz=r.authz or {},
        usage=r.usage or {},
        ratelimit=r.ratelimit or {},
    )
