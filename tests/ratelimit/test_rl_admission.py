"""The contract of the two paths to the limiter: extauthz's typed tenant context and request
facts inside extauthz (ratelimit/admission.py) and the descriptors Envoy builds from the same
values written as metadata (ratelimit/descriptors.py, the template's rate_limits) make the same
Admission."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import yaml
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2

from llmgw import wire
from llmgw.facts import MetaValue, RequestFacts
from llmgw.tenant import TenantContext
from llmgw.tiers import Budget, PerUnit, TenantSpec
from llmgw.topology import Topology
from ratelimit.admission import from_context
from ratelimit.descriptors import parse
from ratelimit.types import Grant
from tools import envoyconf

Entry = ratelimit_pb2.RateLimitDescriptor.Entry
Override = ratelimit_pb2.RateLimitDescriptor.RateLimitOverride


def _rate_limits() -> list[Any]:
    """The route's rate_limits as the template renders them for `python -m ratelimit`."""
    pods = [envoyconf.Address(host="127.0.0.1", port=1)]
    services = envoyconf.Services(
        topology=Topology.RLS,
        extauthz=envoyconf.Address(port=2),
        extauthz_http=envoyconf.Address(port=4),
        ratelimit=envoyconf.Address(port=3),
    )
    rendered = envoyconf.render(envoyconf.EnvoySettings(), envoyconf.Address(), pods, services)
    (listener,) = yaml.safe_load(rendered)["static_resources"]["listeners"]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    route = manager["route_config"]["virtual_hosts"][0]["routes"][0]
    return list(route["typed_per_filter_config"]["envoy.filters.http.ratelimit"]["rate_limits"])


RATE_LIMITS = _rate_limits()


def _value(meta: dict[str, MetaValue], key: dict[str, Any]) -> MetaValue | None:
    assert key["key"] == wire.EXTAUTHZ_NAMESPACE and len(key["path"]) == 1
    return meta.get(key["path"][0]["key"])


def envoy_descriptors(meta: dict[str, MetaValue]) -> rls_pb2.RateLimitRequest:
    """What Envoy sends for extauthz's metadata `meta`, by the rendered config's actions: an
    entry per metadata action whose value is a string (Envoy's metadata action reads strings
    only); a descriptor left out when an action without skip_if_absent has none; the `limit`
    override from the dynamic metadata it names."""
    request = rls_pb2.RateLimitRequest(domain=wire.RATELIMIT_DOMAIN)
    for rate_limit in RATE_LIMITS:
        entries: list[Any] = []
        missing = False
        for action in rate_limit["actions"]:
            if "generic_key" in action:
                key = action["generic_key"]
                entries.append(Entry(key=key["descriptor_key"], value=key["descriptor_value"]))
                continue
            found = _value(meta, action["metadata"]["metadata_key"])
            if isinstance(found, str):
                entries.append(Entry(key=action["metadata"]["descriptor_key"], value=found))
            elif not action["metadata"].get("skip_if_absent"):
                missing = True
        if missing:
            continue
        descriptor = request.descriptors.add(entries=entries)
        limit = _value(meta, rate_limit["limit"]["dynamic_metadata"]["metadata_key"])
        if isinstance(limit, dict):
            unit = rls_pb2.RateLimitResponse.RateLimit.Unit.Value(str(limit["unit"]))
            amount = int(limit["requests_per_unit"])
            descriptor.limit.CopyFrom(Override(requests_per_unit=amount, unit=unit))
    return request


FACTS = RequestFacts(model="m", n=2, max_output=100, prompt_tokens=40)
PER_MINUTE = TenantSpec(requests=PerUnit(minute=100), tokens=PerUnit(minute=5000))
BASE = TenantContext(
    tenant="acme", tier="standard", priority=5, session="sess_1", request_id="req-1", key_id="k"
)


@pytest.mark.parametrize(
    ("context", "request_facts"),
    [
        (BASE, FACTS),
        (replace(BASE, own=PER_MINUTE), FACTS),
        (replace(BASE, own=TenantSpec(requests=PerUnit(minute=100))), FACTS),
        (BASE, RequestFacts()),  # a body that is no JSON object: nothing to reserve
    ],
)
def test_the_context_and_the_descriptors_make_the_same_admission(
    context: TenantContext, request_facts: RequestFacts
) -> None:
    """What extauthz writes, through Envoy's descriptors, is what the limiter inside takes."""
    meta = {**context.to_metadata(), **request_facts.to_metadata()}
    assert from_context(context, request_facts) == parse(envoy_descriptors(meta)).admission


def test_what_the_admission_holds() -> None:
    own = PER_MINUTE.model_copy(update={"budget": Budget(tokens=700)})
    admission = from_context(replace(BASE, own=own), FACTS)
    assert (admission.tenant, admission.tier, admission.session) == ("acme", "standard", "sess_1")
    assert admission.token_estimate == 40 + 2 * 100 and admission.grant == Grant(40, 2)
    assert admission.own == own  # the budget too: in-process, the tenant's whole spec
