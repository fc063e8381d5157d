"""The pod-batches contract (router → ledger): each pod's running requests at each scrape, what
a request's GPU time is estimated from (ledger/gputime.py).

Every router replica (`python -m router`, or inside each extauthz) adds one `PodBatches` a
second to the Redis stream `llmgw.wire.POD_BATCHES_KEY` (XADD, its length capped near
`STREAM_KEPT` entries): the scrapes it made since its previous entry. The ledger reads the
stream from where it left off (XREAD), so no replica's entry is missed whatever the timing, and
replicas' scrapes of one pod interleave. Bounded: `SCRAPES_KEPT` scrapes a pod an entry (the
latest), `PODS_KEPT` pods; an entry beyond them is refused whole by the reader.

    {"ts": 1767225600.123, "pods": {"10.0.0.7:8000": [[1767225599.4, 12], [1767225599.5, 13]]}}
"""

from __future__ import annotations

from typing import Annotated, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

SCRAPES_KEPT = 64  # a pod's scrapes in one entry: 13 a second at the default interval
PODS_KEPT = 4096
STREAM_KEPT = 1000  # entries: 1,000 s of one replica, 100 s of ten


class Scrape(NamedTuple):
    at: Annotated[float, Field(ge=0)]  # Unix seconds the pod answered
    running: Annotated[float, Field(ge=0)]  # its vllm:num_requests_running


class PodBatches(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore", allow_inf_nan=False)

    ts: float  # Unix seconds the entry was made
    # By the pod's "ip:port", as Envoy's access log names it; oldest first.
    pods: dict[str, Annotated[list[Scrape], Field(max_length=SCRAPES_KEPT)]] = Field(
        default_factory=dict, max_length=PODS_KEPT
    )
