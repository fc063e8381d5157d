"""Envoy's access-log entry → Outcome: kinds and charged tokens, case by case (ledger/entry.py)."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from envoy.config.core.v3 import address_pb2
from envoy.data.accesslog.v3 import accesslog_pb2

from ledger.entry import to_outcome
from llmgw import facts, wire
from llmgw.tenant import TenantContext
from llmgw.tiers import PerUnit, Spend, TenantSpec

POD = "10.0.0.1:8000"
OWN = TenantSpec(requests=PerUnit(minute=60))


def entry(
    status: int,
    *,
    pod: str | None = POD,
    usage: dict[str, Any] | None = None,
    admission: dict[str, Any] | None = None,
    stream: bool = False,
    flags: tuple[str, ...] = (),
    request_id: str = "r1",
    authenticated: bool = True,
    path: str = "/v1/chat/completions",
    authz: dict[str, Any] | None = None,
    own: TenantSpec | None = OWN,
) -> accesslog_pb2.HTTPAccessLogEntry:
    e = accesslog_pb2.HTTPAccessLogEntry()
    common = e.common_properties
    if authenticated:
        request_facts = facts.RequestFacts(
            model="m", stream=stream, max_output=100, prompt_tokens=20
        )
        context = TenantContext(
            tenant="acme",
            tier="free",
            priority=3,
            session="sess_1",
            request_id=request_id,
            key_id="key_abcdefgh",
            own=own,
        )
        common.metadata.filter_metadata[wire.EXTAUTHZ_NAMESPACE].update(
            {**context.to_metadata(), **request_facts.to_metadata(), **(authz or {})}
        )
    else:
        e.request.request_id = request_id
    if usage:
        common.metadata.filter_metadata[wire.USAGE_NAMESPACE].update(usage)
    if admission is not None:
        common.metadata.filter_metadata[wire.RATELIMIT_NAMESPACE].update(admission)
    if pod:
        host, port = pod.split(":")
        common.upstream_remote_address.CopyFrom(
            address_pb2.Address(
                socket_address=address_pb2.SocketAddress(address=host, port_value=int(port))
            )
        )
    for name in flags:
        if name == "unauthorized":
            common.response_flags.unauthorized_details.reason = 1
        else:
            setattr(common.response_flags, name, True)
    common.start_time.FromSeconds(1_800_000_000)
    common.time_to_first_downstream_tx_byte.FromMilliseconds(12)
    common.duration.FromMilliseconds(340)
    common.upstream_request_attempt_count = 1
    e.request.path = path
    if status:
        e.response.response_code.value = status
    return e


USED = {wire.META_PROMPT_TOKENS: 31, wire.META_COMPLETION_TOKENS: 9}


def test_a_complete_answer_is_ok_and_charged_its_usage() -> None:
    o = to_outcome(entry(200, usage=USED, path="/v1/chat/completions?api_key=secret"))
    assert o is not None
    assert (o.outcome, o.status, o.pod, o.tenant, o.session, o.key_id) == (
        "ok", 200, POD, "acme", "sess_1", "key_abcdefgh",
    )  # fmt: skip
    assert (o.prompt_tokens, o.completion_tokens, o.reserved_tokens) == (31, 9, 120)
    assert (o.ttft_ms, o.duration_ms, o.endpoint) == (12.0, 340.0, "/v1/chat/completions")
    assert o.spend is None  # the tier's money budgets apply


def test_the_record_carries_the_tenants_own_money_budgets_for_the_soft_limits() -> None:
    spend = Spend(day=Decimal("3"), alert_at=(75,))
    o = to_outcome(entry(200, usage=USED, own=TenantSpec(spend=spend)))
    assert o is not None and o.spend == spend
    assert "spend" not in o.model_dump()  # not a column of the ledger


def test_a_stream_the_client_left_is_charged_prompt_estimate_plus_streamed_events() -> None:
    o = to_outcome(
        entry(200, stream=True, usage={wire.META_STREAMED_EVENTS: 7},
              flags=("downstream_connection_termination",))
    )  # fmt: skip
    assert o is not None and (o.outcome, o.flags) == ("aborted", "DC")
    assert (o.prompt_tokens, o.completion_tokens) == (20, 7)


def test_per_chunk_usage_wins_over_the_event_count() -> None:
    usage = {**USED, wire.META_STREAMED_EVENTS: 5}  # vLLM >= 0.20: usage on every chunk
    o = to_outcome(entry(0, stream=True, usage=usage, flags=("downstream_connection_termination",)))
    assert o is not None and o.outcome == "aborted"
    assert (o.prompt_tokens, o.completion_tokens) == (31, 9)


def test_a_stream_the_pod_broke_is_an_upstream_error_charged_what_streamed() -> None:
    reset = to_outcome(
        entry(
            200, stream=True, usage={wire.META_STREAMED_EVENTS: 4}, flags=("upstream_remote_reset",)
        )
    )
    failed = to_outcome(
        entry(200, stream=True,
              usage={wire.META_STREAMED_EVENTS: 3, wire.META_STREAM_FAILED: True})
    )  # fmt: skip
    for o, streamed in ((reset, 4), (failed, 3)):
        assert o is not None and o.outcome == "upstream_error"
        assert (o.prompt_tokens, o.completion_tokens) == (20, streamed)


@pytest.mark.parametrize(
    ("status", "pod", "flags", "kind"),
    [
        (401, None, ("unauthorized",), "refused"),
        (429, None, ("rate_limited",), "refused"),
        (404, None, ("no_route_found",), "refused"),
        (503, None, ("no_healthy_upstream",), "upstream_error"),
        (503, POD, ("upstream_connection_failure",), "upstream_error"),
        (500, POD, (), "upstream_error"),
        (400, POD, (), "refused"),  # the pod refused it as invalid: the client's mistake
    ],
)
def test_errors_before_any_output_are_charged_nothing(
    status: int, pod: str | None, flags: tuple[str, ...], kind: str
) -> None:
    o = to_outcome(entry(status, pod=pod, flags=flags))
    assert o is not None and o.outcome == kind
    assert (o.prompt_tokens, o.completion_tokens) == (0, 0)


def test_an_unauthenticated_request_is_recorded_without_a_tenant() -> None:
    o = to_outcome(entry(401, pod=None, flags=("unauthorized",), authenticated=False))
    assert o is not None and (o.tenant, o.request_id, o.outcome, o.flags) == (
        "", "r1", "refused", "UAEX",
    )  # fmt: skip
    assert to_outcome(entry(401, pod=None, authenticated=False, request_id="")) is None


def test_a_complete_answer_without_usage_is_charged_its_reservation() -> None:
    o = to_outcome(entry(200))
    assert o is not None and (o.prompt_tokens, o.completion_tokens) == (20, 100)


def test_a_non_stream_answer_cut_short_is_charged_the_whole_reservation() -> None:
    """It shows nothing until it is done: the pod may have generated up to the cap."""
    gone = to_outcome(entry(0, flags=("downstream_connection_termination",)))
    assert gone is not None and gone.outcome == "aborted"
    assert gone.prompt_tokens + gone.completion_tokens == 120
    timed_out = entry(504, flags=("stream_idle_timeout",))
    timed_out.common_properties.upstream_request_attempt_count = 3  # Envoy tried three times
    o = to_outcome(timed_out)
    assert o is not None and o.outcome == "upstream_error"
    assert o.prompt_tokens + o.completion_tokens == 3 * 120


@pytest.mark.parametrize("status", [0, 200])
def test_a_request_whose_budget_lowered_its_cap_is_charged_the_reservation_at_that_cap(
    status: int,
) -> None:
    """Its estimate (20 + 100) was made before the budget lowered the cap to 30: a non-stream
    request cut short, or answered without usage, is charged 20 + 30, what was reserved."""
    capped = {wire.META_DECIDED: True, wire.META_OUTPUT_CAP: 30.0}
    flags = ("downstream_connection_termination",) if status == 0 else ()
    o = to_outcome(entry(status, authz=capped, flags=flags))
    assert o is not None and (o.prompt_tokens, o.completion_tokens) == (20, 30)
    assert o.reserved_tokens == 50


def test_an_aborted_stream_charges_the_larger_prompt_count() -> None:
    small = {wire.META_PROMPT_TOKENS: 5, wire.META_STREAMED_EVENTS: 2}  # one choice's own usage
    o = to_outcome(
        entry(200, stream=True, usage=small, flags=("downstream_connection_termination",))
    )
    assert o is not None and (o.prompt_tokens, o.completion_tokens) == (20, 2)


def test_a_borrowed_admission_is_recorded_and_base_quota_is_zero() -> None:
    drawn = {wire.META_BORROWED_REQUESTS: 1, wire.META_BORROWED_TOKENS: 120}
    borrowed = to_outcome(entry(200, usage=USED, admission=drawn))
    assert borrowed is not None
    assert (borrowed.borrowed_requests, borrowed.borrowed_tokens) == (1, 120)
    base = to_outcome(entry(200, usage=USED, admission={wire.META_DECIDED: True}))
    assert base is not None and (base.borrowed_requests, base.borrowed_tokens) == (0, 0)


@pytest.mark.parametrize(
    ("admission", "checked"),
    [
        ({wire.META_DECIDED: True}, True),
        ({wire.META_DECIDED: True, wire.META_BORROWED_REQUESTS: 1}, True),
        (None, False),  # no metadata: Envoy admitted without an answer (fail-open)
        ({wire.META_DECIDED: "true"}, False),
    ],
)
def test_a_rate_limit_decision_is_recorded(admission: dict[str, Any] | None, checked: bool) -> None:
    o = to_outcome(entry(200, usage=USED, admission=admission))
    assert o is not None and o.quota_checked is checked


@pytest.mark.parametrize(
    "drawn",
    [
        {},
        {wire.META_BORROWED_REQUESTS: "1", wire.META_BORROWED_TOKENS: True},
        {wire.META_BORROWED_REQUESTS: -1, wire.META_BORROWED_TOKENS: {"n": 5}},
    ],
)
def test_mistyped_borrowing_metadata_counts_as_base_quota(drawn: dict[str, Any]) -> None:
    o = to_outcome(entry(200, usage=USED, admission=drawn))
    assert o is not None and (o.borrowed_requests, o.borrowed_tokens) == (0, 0)


def test_a_stream_left_before_the_pod_reported_usage_is_charged_the_prompt_bound() -> None:
    """Without the model's tokenizer the prompt is an estimate (20) that a dense prompt exceeds;
    its UTF-8 bytes (61) no byte-level tokenizer does. Once the pod reports it, its count wins."""
    left = entry(0, stream=True, flags=("downstream_connection_termination",))
    authz = left.common_properties.metadata.filter_metadata[wire.EXTAUTHZ_NAMESPACE]
    authz.update({wire.META_PROMPT_BOUND: 61.0})
    o = to_outcome(left)
    assert o is not None and o.outcome == "aborted"
    assert (o.prompt_tokens, o.completion_tokens) == (61, 0)
    authz.update({wire.META_PROMPT_BOUND: 0.0})  # none sent (an older extauthz): the estimate
    o = to_outcome(left)
    assert o is not None and (o.prompt_tokens, o.completion_tokens) == (20, 0)
    left.common_properties.metadata.filter_metadata[wire.USAGE_NAMESPACE].update(
        {wire.META_PROMPT_TOKENS: 45, wire.META_COMPLETION_TOKENS: 0}
    )
    authz.update({wire.META_PROMPT_BOUND: 61.0})
    o = to_outcome(left)
    assert o is not None and (o.prompt_tokens, o.completion_tokens) == (45, 0)


@pytest.mark.parametrize(("queue_ms", "reserved"), [(None, False), (1500.0, True), (0.0, True)])
def test_flow_controls_refusal_had_a_reservation_the_limiters_had_none(
    queue_ms: float | None, reserved: bool
) -> None:
    """Both are the gateway's 429 (UAEX, the limiter decided): the limiter's refusal reserved
    nothing, flow control's (queue_full, queue_timeout: its wait in the metadata) came after
    the admission that reserved its tokens, which settlement must release."""
    waited = {} if queue_ms is None else {wire.META_QUEUE_MS: queue_ms}
    checked = {wire.META_DECIDED: True}
    o = to_outcome(entry(429, pod=None, admission=checked, flags=("unauthorized",), authz=waited))
    assert o is not None and o.by_gateway and o.queue_ms == queue_ms
    assert o.reserved is reserved


def test_a_stored_response_read_again_is_not_charged_and_its_endpoint_is_the_route() -> None:
    """GET /v1/responses/{id} shows the stored response's usage: it was charged when generated.
    Its ID is the route's parameter in the ledger (a bounded set of endpoints)."""
    for tail in ("", "/cancel"):
        read = entry(
            200,
            usage=USED,
            path=f"/v1/responses/resp_abc{tail}?x=1",
            authz={wire.META_TOKEN_ESTIMATE: "0"},
        )
        outcome = to_outcome(read)
        assert outcome is not None and outcome.outcome == "ok"
        assert (outcome.prompt_tokens, outcome.completion_tokens) == (0, 0)
        assert outcome.endpoint == "/v1/responses/{id}" + tail
    generated = to_outcome(entry(200, usage=USED, path=wire.RESPONSES_PATH))
    assert generated is not None and generated.prompt_tokens == 31


def test_a_follow_up_cut_short_pays_its_own_input_not_the_history_it_reserved() -> None:
    """A stored conversation's follow-up reserves its history (up to the model's context) beside
    its own prompt; only the pod knows how long the history was, so a request that never
    reported its usage is charged its own prompt and cap, as any other."""
    history = 8_000
    reserved = {
        wire.META_TOKEN_ESTIMATE: str(history + 20 + 100),
        wire.META_TOKEN_PROMPT: str(history + 20),
        wire.META_TOKEN_CEILING: str(history + 20),
    }
    left = to_outcome(
        entry(200, stream=True, usage={wire.META_STREAMED_EVENTS: 3}, authz=reserved,
              flags=("downstream_connection_termination",))
    )  # fmt: skip
    assert left is not None and (left.prompt_tokens, left.completion_tokens) == (20, 3)
    timed_out = to_outcome(entry(504, authz=reserved, flags=("upstream_request_timeout",)))
    assert timed_out is not None and timed_out.outcome == "upstream_error"
    assert (timed_out.prompt_tokens, timed_out.completion_tokens) == (20, 100)
    assert timed_out.reserved_tokens == 120
    reported = to_outcome(entry(200, usage=USED, authz=reserved))  # the pod's count wins
    assert reported is not None and (reported.prompt_tokens, reported.completion_tokens) == (31, 9)
