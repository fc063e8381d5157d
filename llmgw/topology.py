"""The supported topologies: where the rate limiter and the router run, and how Envoy asks
extauthz for the check. One name per shape; README "Topologies" says what runs where.

extauthz always answers Envoy's key question at the headers on its HTTP port; what differs is
the check with the body, and who admits and picks.
"""

from __future__ import annotations

import logging
from enum import StrEnum
from typing import Any

from llmgw.config import deprecated

log = logging.getLogger(__name__)


class Topology(StrEnum):
    # The check over HTTP, the rate limiter and the router inside extauthz: one exchange per
    # request. What compose and Kubernetes deploy.
    GATEWAY = "gateway"
    # The same checked over gRPC (Envoy's ext_authz grpc_service).
    GRPC_CHECK = "grpc-check"
    # The rate limiter apart (`python -m ratelimit`), behind Envoy's rate-limit filter; the
    # router inside extauthz; the check over gRPC (the limiter reads the facts from Envoy's
    # metadata, which over HTTP are strings without the tenant's limit overrides).
    RLS = "rls"
    # The router apart (`python -m router`) as the endpoint picker behind ext_proc (for any
    # gateway, the InferencePool protocol: docs/inference-pool.md); the rate limiter inside
    # extauthz; the check over gRPC (the router reads extauthz's facts from the metadata).
    EPP = "epp"

    @property
    def check_over_http(self) -> bool:
        return self is Topology.GATEWAY

    @property
    def limiter_inside(self) -> bool:
        return self is not Topology.RLS

    @property
    def router_inside(self) -> bool:
        return self is not Topology.EPP

    @classmethod
    def of(cls, *, limiter_inside: bool, router_inside: bool, check_over_http: bool) -> Topology:
        """The topology of that shape (the deprecated booleans'); ValueError for a shape that
        has no name."""
        for topology in cls:
            shape = (topology.limiter_inside, topology.router_inside, topology.check_over_http)
            if shape == (limiter_inside, router_inside, check_over_http):
                return topology
        raise ValueError(
            f"no topology has the rate limiter {'inside' if limiter_inside else 'apart'}, the "
            f"router {'inside' if router_inside else 'apart'} and the check over "
            f"{'HTTP' if check_over_http else 'gRPC'}; the topologies: "
            + ", ".join(t.value for t in cls)
        )


def pop_deprecated(
    data: dict[str, Any], defaults: dict[str, bool], where: str
) -> list[bool] | None:
    """The deprecated booleans `defaults` names, in its order, popped from settings `data` (a
    missing one: its default), each given one logged; None when none is given."""
    given = [name for name in defaults if name in data]
    if not given:
        return None
    if "topology" in data:
        raise ValueError(f"{', '.join(given)}: deprecated, and `topology` is given: drop it")
    for name in given:
        deprecated(f"{where} `{name}`", "`topology`")
        if not isinstance(data[name], bool):
            raise ValueError(f"{name}: {data[name]!r} is not a boolean")
    return [data.pop(name, default) for name, default in defaults.items()]
