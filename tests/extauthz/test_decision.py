from __future__ import annotations

import json
from pathlib import Path

import pytest

from extauthz import tenants
from extauthz.answers import metadata
from extauthz.decision import Decider
from extauthz.responseids import Kept
from extauthz.types import Allow, Deny, Snapshot
from llmgw import wire
from llmgw.facts import MESSAGE_TOKENS
from llmgw.tenant import TenantContext
from llmgw.tiers import Budget, PerUnit, TenantSpec
from tests.extauthz.conftest import NOW_S, SECRET, TIERS, Keys, make_decider

# One user message: the chat template's tokens around it, and its role ("user": 1 token).
CHAT = 2 * MESSAGE_TOKENS + 1


@pytest.fixture
def snap(tenants_file: Path, keys: Keys) -> Snapshot:
    return tenants.load(tenants_file, TIERS)


def chat(model: str = "llama-3-8b", content: object = "x" * 400, **extra: object) -> bytes:
    return json.dumps(
        {"model": model, "messages": [{"role": "user", "content": content}], **extra}
    ).encode()


def bearer(key: str, **headers: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}", **headers}


def allowed(decision: object) -> Allow:
    assert isinstance(decision, Allow), decision
    return decision


def denied(decision: object, status: int, code: str) -> Deny:
    assert isinstance(decision, Deny), decision
    assert (decision.status, decision.code) == (status, code)
    envelope = json.loads(decision.body())
    assert set(envelope) == {"error"}
    assert set(envelope["error"]) == {"message", "type", "code", "param"}
    assert envelope["error"]["code"] == code
    assert envelope["error"]["type"] == "invalid_request_error"
    return decision


def test_allow_sets_the_trusted_context(decider: Decider, snap: Snapshot, keys: Keys) -> None:
    body = chat(max_tokens=50)
    d = allowed(decider.decide(snap, bearer(keys.acme, **{"x-request-id": "r-1"}), body, NOW_S))
    headers = dict(d.headers)
    assert headers[wire.HEADER_TENANT] == "acme"
    assert headers[wire.HEADER_TIER] == "standard"
    assert headers[wire.HEADER_PRIORITY] == "5"
    assert headers[wire.HEADER_MODEL] == "llama-3-8b"
    assert headers[wire.HEADER_TOKEN_ESTIMATE] == str(CHAT + 150)  # 400 chars / 4 + 50
    assert headers[wire.HEADER_REQUEST_ID] == "r-1"
    assert headers[wire.HEADER_SESSION].startswith("sess_")
    assert d.response_headers == ((wire.HEADER_SESSION, headers[wire.HEADER_SESSION]),)
    assert d.headers_to_remove == ("authorization",)
    # Typed in the process (the limiter and the router inside take it as it is)...
    assert d.context == TenantContext(
        tenant="acme",
        tier="standard",
        priority=5,
        session=headers[wire.HEADER_SESSION],
        request_id="r-1",
        key_id=keys.acme_key_id,
        own=TenantSpec(requests=PerUnit(minute=100)),
    )
    assert (d.facts.model, d.facts.max_output, d.facts.token_estimate) == (
        "llama-3-8b",
        50,
        CHAT + 150,
    )
    # ... and written for Envoy at the edge.
    assert metadata(d) == {
        wire.META_TENANT: "acme",
        wire.META_TIER: "standard",
        wire.META_PRIORITY: 5.0,
        wire.META_SESSION: headers[wire.HEADER_SESSION],
        wire.META_REQUEST_ID: "r-1",
        wire.META_KEY_ID: metadata(d)[wire.META_KEY_ID],
        wire.META_LIMIT_REQUESTS: {"requests_per_unit": 100.0, "unit": "MINUTE"},
        # The request facts (llmgw/facts.py): the body parsed once, for everyone after extauthz.
        wire.META_MODEL: "llama-3-8b",
        wire.META_TOKEN_ESTIMATE: str(CHAT + 150),
        # Its parts, as strings for the rate-limit descriptors (a budget may lower the cap).
        wire.META_TOKEN_PROMPT: str(CHAT + 100),
        wire.META_TOKEN_CHOICES: "1",
        # What prices it for money budgets: the prompt's ceiling (its bound, below).
        wire.META_TOKEN_CEILING: str(4 + 400 + 2 * MESSAGE_TOKENS),
        wire.META_PROMPT_ESTIMATE: float(CHAT + 100),
        # The most it can be: the text's UTF-8 bytes ("user" and 400 characters of ASCII).
        wire.META_PROMPT_BOUND: float(4 + 400 + 2 * MESSAGE_TOKENS),
        wire.META_MAX_OUTPUT: 50.0,
        wire.META_CHOICES: 1.0,
        wire.META_STREAM: False,
        wire.META_INCLUDE_USAGE: False,
        wire.META_FIRST_TURN: True,
        wire.META_PREFIX_BLOCKS: metadata(d)[wire.META_PREFIX_BLOCKS],
        # Appended to the body by Envoy (envoy/rewrite.lua): the tenant's cache salt.
        wire.META_BODY_SUFFIX: metadata(d)[wire.META_BODY_SUFFIX],
    }
    assert str(metadata(d)[wire.META_BODY_SUFFIX]).startswith(',"cache_salt": "')
    assert str(metadata(d)[wire.META_KEY_ID]).startswith("key_")
    assert len(str(metadata(d)[wire.META_PREFIX_BLOCKS])) == 16 * 6  # 6 full blocks of 64 chars


def test_a_custom_tier_reaches_the_metadata_by_name_only(
    decider: Decider, snap: Snapshot, keys: Keys
) -> None:
    """Its limits are the tier table's (read by ratelimit), not a second copy sent along."""
    d = allowed(decider.decide(snap, {"api-key": keys.globex}, chat("any-model"), NOW_S))
    assert d.tenant == "globex"
    assert metadata(d)[wire.META_TIER] == "gold"
    assert wire.META_LIMIT_REQUESTS not in metadata(d)
    assert wire.META_LIMIT_TOKENS not in metadata(d)
    assert d.headers_to_remove == ("api-key",)
    assert len(dict(d.headers)[wire.HEADER_REQUEST_ID]) == 36  # minted when Envoy sent none


@pytest.mark.parametrize(
    ("headers", "which"),
    [
        ({}, "missing"),
        ({"authorization": "Basic dXNlcjpwYXNz"}, "malformed"),
        ({"authorization": "Bearer"}, "malformed"),
        ({"authorization": "Bearer sk-other-123"}, "malformed"),
        ({"authorization": "Bearer sk-llmgw-" + "A" * 43}, "unknown"),
        ({"api-key": "sk-llmgw-" + "x" * 300}, "malformed"),
        ("expired", "expired"),
        ("revoked", "revoked"),
    ],
)
def test_bad_keys_get_401(
    decider: Decider, snap: Snapshot, keys: Keys, headers: object, which: str
) -> None:
    if isinstance(headers, str):
        headers = bearer(getattr(keys, headers))
    assert isinstance(headers, dict)
    d = denied(decider.decide(snap, headers, chat(), NOW_S), 401, "invalid_api_key")
    assert d.tenant is None


def test_paths_without_a_body_still_need_a_key(
    decider: Decider, snap: Snapshot, keys: Keys
) -> None:
    denied(decider.decide(snap, {":path": "/v1/models"}, b"", NOW_S), 401, "invalid_api_key")
    d = allowed(decider.decide(snap, bearer(keys.acme), b"", NOW_S))
    assert dict(d.headers)[wire.HEADER_TOKEN_ESTIMATE] == "0"
    assert wire.META_MODEL not in metadata(d)


def test_forged_context_headers_never_survive(decider: Decider, snap: Snapshot, keys: Keys) -> None:
    forged = bearer(
        keys.acme,
        **{
            wire.HEADER_TENANT: "globex",
            wire.HEADER_TIER: "platinum",
            wire.HEADER_PRIORITY: "10",
            wire.HEADER_MODEL: "gpt-4",
            wire.HEADER_TOKEN_ESTIMATE: "1",
            "x-llmgw-anything": "1",
            wire.DESTINATION_ENDPOINT: "10.0.0.1:8000",
        },
    )
    d = allowed(decider.decide(snap, forged, b"not json", NOW_S))
    headers = dict(d.headers)
    assert headers[wire.HEADER_TENANT] == "acme"
    assert headers[wire.HEADER_TIER] == "standard"
    assert headers[wire.HEADER_PRIORITY] == "5"
    assert headers[wire.HEADER_TOKEN_ESTIMATE] == "0"
    assert set(d.headers_to_remove) == {
        "authorization",
        wire.HEADER_MODEL,  # no model in this body: the forged one must go
        "x-llmgw-anything",
        wire.DESTINATION_ENDPOINT,
    }
    # Every x-llmgw-* name the client sent is either overwritten or removed.
    sent = {name for name in forged if name.startswith(wire.HEADER_PREFIX)}
    assert sent <= set(headers) | set(d.headers_to_remove)


def test_model_not_allowed_is_403(decider: Decider, snap: Snapshot, keys: Keys) -> None:
    d = denied(
        decider.decide(snap, bearer(keys.acme), chat("gpt-4"), NOW_S), 403, "model_not_allowed"
    )
    assert d.param == "model"
    assert d.tenant == "acme"
    bad_name = chat("llama-3-8b\r\nx-evil: 1")
    denied(decider.decide(snap, bearer(keys.acme), bad_name, NOW_S), 403, "model_not_allowed")
    allowed(decider.decide(snap, bearer(keys.acme), chat("mistral-7b"), NOW_S))


@pytest.mark.parametrize(
    "headers",
    [{}, {wire.HEADER_PARTIAL_BODY: "true"}, {"content-length": "10001"}],
)
def test_too_large_is_413(snap: Snapshot, keys: Keys, headers: dict[str, str]) -> None:
    small = make_decider(max_body_bytes=10_000)
    body = chat(content="x" * 20_000) if not headers else chat()
    d = small.decide(snap, bearer(keys.acme, **headers), body, NOW_S)
    denied(d, 413, "request_too_large")


def test_too_large_checked_after_the_key(decider: Decider, snap: Snapshot) -> None:
    denied(decider.decide(snap, {}, b"x" * 20_000, NOW_S), 401, "invalid_api_key")


def test_non_json_body_passes_for_the_pod_to_answer(
    decider: Decider, snap: Snapshot, keys: Keys
) -> None:
    for body in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        d = allowed(decider.decide(snap, bearer(keys.acme), body, NOW_S))
        assert d.facts.model is None


@pytest.mark.parametrize(
    ("body", "estimate"),
    [
        (chat(content="x" * 401, max_completion_tokens=10, max_tokens=99), CHAT + 101 + 10),
        (chat(content="x" * 8), CHAT + 2 + 4096),  # the gateway's cap when the client names none
        (chat(content=[{"type": "text", "text": "y" * 40}], max_tokens=0), CHAT + 10),
        # two prompts: each gets its own completion, of vLLM's default 16 tokens
        (
            json.dumps({"model": "llama-3-8b", "prompt": ["ab" * 10, "c" * 20]}).encode(),
            10 + 2 * 16,
        ),
        (json.dumps({"model": "llama-3-8b", "prompt": [1, 2, 3], "max_tokens": 7}).encode(), 10),
    ],
)
def test_token_estimate(
    decider: Decider, snap: Snapshot, keys: Keys, body: bytes, estimate: int
) -> None:
    d = allowed(decider.decide(snap, bearer(keys.acme), body, NOW_S))
    assert metadata(d)[wire.META_TOKEN_ESTIMATE] == str(estimate)


def as_the_pod_reads_it(body: bytes, decision: Allow) -> dict[str, object]:
    """The body after Envoy appended the suffix (envoy/rewrite.lua: before the last "}"),
    parsed as the pod parses JSON: the last of duplicate keys wins."""
    at = body.rindex(b"}")
    suffix = str(metadata(decision)[wire.META_BODY_SUFFIX]).encode()
    parsed = json.loads(body[:at] + suffix + body[at:])
    assert isinstance(parsed, dict)
    return parsed


def pod_cap(request: dict[str, object], path: str) -> object:
    """The output cap vLLM uses: chat reads max_completion_tokens first."""
    if path == wire.CHAT_PATH and request.get("max_completion_tokens") is not None:
        return request["max_completion_tokens"]
    return request.get("max_tokens")


CAPPED = {"max_output_tokens": 1000, "max_model_len": {"llama-3-8b": 800}}
# gold's own output cap, in the tier table beside its limits.
CAPPED_TIERS = TIERS.model_copy(
    update={"tiers": {"gold": TIERS.tiers["gold"].model_copy(update={"max_output_tokens": 50})}}
)


@pytest.fixture
def capped(tenants_file: Path, keys: Keys) -> Snapshot:
    return tenants.load(tenants_file, CAPPED_TIERS)


# Caps the pod would not read as a cap (the gateway's replaces them): the client names none.
OPEN: list[dict[str, object]] = [
    {},  # the OpenAI SDK's default: no cap at all
    {"max_tokens": None, "max_completion_tokens": None},
    {"max_tokens": -1},
    {"max_tokens": "nan", "n": "2.0"},
]


@pytest.mark.parametrize(
    "extra",
    [
        *OPEN,
        {"max_tokens": 10**20},
        {"max_tokens": 1e20, "n": 3},
        {"max_tokens": True},
        {"max_tokens": 20, "max_completion_tokens": 5000},  # the one chat reads is too large
        {"max_completion_tokens": 7, "max_tokens": 5000},
        {"max_tokens": 30, "n": 4, "best_of": 6},
    ],
)
@pytest.mark.parametrize("path", [wire.CHAT_PATH, "/v1/completions"])
@pytest.mark.parametrize("tenant", ["acme", "globex"])
def test_the_pod_gets_the_cap_the_reservation_holds(
    capped: Snapshot, keys: Keys, extra: dict[str, object], path: str, tenant: str
) -> None:
    """Whatever the client names (or not), the pod's cap is the one reserved, within the
    tier's cap, and within the model's context when the client names none: acme is standard
    (1000) on a model of context 800, globex is gold (50)."""
    decider = make_decider(**CAPPED)
    shape: dict[str, object] = {"messages": [{"role": "user", "content": "x" * 40}]}
    if path != wire.CHAT_PATH:
        shape = {"prompt": "x" * 40}
    body = json.dumps({"model": "llama-3-8b", **shape, **extra}).encode()
    headers = {**bearer(getattr(keys, tenant)), ":path": path, ":method": "POST"}
    d = allowed(decider.decide(capped, headers, body, NOW_S))
    cap = pod_cap(as_the_pod_reads_it(body, d), path)
    assert isinstance(cap, int) and not isinstance(cap, bool)
    assert cap == metadata(d)[wire.META_MAX_OUTPUT]
    assert cap <= (1000 if tenant == "acme" else 50)
    if extra in OPEN:
        assert cap <= 800
    n = metadata(d)[wire.META_CHOICES]
    assert isinstance(n, float)
    prompt = 10 + (CHAT if path == wire.CHAT_PATH else 0)
    assert metadata(d)[wire.META_TOKEN_ESTIMATE] == str(prompt + cap * int(n))
    if not extra:  # no cap named: the whole bound (completions: vLLM's default of 16)
        assert cap == (16 if path != wire.CHAT_PATH else 800 if tenant == "acme" else 50)


def test_the_cap_follows_the_tier_and_the_model(capped: Snapshot, keys: Keys) -> None:
    decider = make_decider(**CAPPED)
    caps = {
        (key, model): metadata(
            allowed(decider.decide(capped, bearer(key, **GENERATION), chat(model), NOW_S))
        )[wire.META_MAX_OUTPUT]
        for key in (keys.acme, keys.globex)
        for model in ("llama-3-8b", "mistral-7b")
    }
    assert caps == {
        (keys.acme, "llama-3-8b"): 800,  # the model's context
        (keys.acme, "mistral-7b"): 1000,  # context unknown: the tier's cap
        (keys.globex, "llama-3-8b"): 50,
        (keys.globex, "mistral-7b"): 50,
    }


class Fleet(dict[str, int]):
    """The fleet's contexts as the router's datastore or the fleet load give them."""

    def context(self, model: str) -> int | None:
        return self.get(model)


def sent_cap(decider: Decider, snap: Snapshot, key: str, body: bytes) -> object:
    """The output cap the pod reads, the one reserved."""
    d = allowed(decider.decide(snap, bearer(key, **GENERATION), body, NOW_S))
    cap = pod_cap(as_the_pod_reads_it(body, d), wire.CHAT_PATH)
    assert metadata(d)[wire.META_MAX_OUTPUT] == cap
    return cap


@pytest.mark.parametrize(
    ("extra", "names"),
    [
        ({}, {"max_tokens"}),
        ({"max_tokens": 2000}, {"max_tokens"}),
        ({"max_completion_tokens": None, "max_tokens": 2000}, {"max_tokens"}),
        ({"max_completion_tokens": 2000}, {"max_tokens", "max_completion_tokens"}),
        ({"max_completion_tokens": -1}, {"max_tokens", "max_completion_tokens"}),
    ],
)
def test_the_cap_goes_under_the_name_the_pod_reads(
    snap: Snapshot, keys: Keys, extra: dict[str, object], names: set[str]
) -> None:
    """vLLM's chat reads max_completion_tokens unless it is null: the gateway names it only to
    replace the client's, so a cap the pod refuses is refused naming what the client named."""
    d = allowed(make_decider().decide(snap, bearer(keys.acme, **GENERATION), chat(**extra), NOW_S))
    suffix = json.loads("{" + str(metadata(d)[wire.META_BODY_SUFFIX]).lstrip(",") + "}")
    assert set(suffix) - {"cache_salt", "request_id"} == names


def test_the_default_cap_is_within_the_fleets_context(snap: Snapshot, keys: Keys) -> None:
    """SDK-default requests (no cap) on pods started with --max-model-len 1200: the tier's 4,096
    would be refused by every pod, the context is served (vLLM lowers it beside the prompt)."""
    decider = make_decider(Fleet({"llama-3-8b": 1200}))
    assert sent_cap(decider, snap, keys.acme, chat()) == 1200
    assert sent_cap(decider, snap, keys.acme, chat(max_tokens=None)) == 1200
    # A model whose context the router does not know (yet): the tier's cap, as before.
    assert sent_cap(decider, snap, keys.acme, chat("mistral-7b")) == 4096


def test_the_default_cap_is_the_least_of_tier_fleet_and_operator(
    capped: Snapshot, keys: Keys
) -> None:
    """acme's tier cap is 1000, globex's 50; the operator says llama's context is 800."""
    caps = {
        (fleet, tenant): sent_cap(
            make_decider(Fleet({"llama-3-8b": fleet}), **CAPPED), capped, key, chat()
        )
        for fleet in (600, 900, 5000)
        for tenant, key in (("acme", keys.acme), ("globex", keys.globex))
    }
    assert caps == {
        (600, "acme"): 600,  # the fleet's
        (900, "acme"): 800,  # the operator's
        (5000, "acme"): 800,
        (600, "globex"): 50,  # the tier's
        (900, "globex"): 50,
        (5000, "globex"): 50,
    }


def test_a_cap_the_client_names_is_left_to_the_pod(snap: Snapshot, keys: Keys) -> None:
    """Above the context vLLM refuses it (its own 400, as without the gateway); the gateway
    lowers it only to the tier's cap."""
    decider = make_decider(Fleet({"llama-3-8b": 1200}))
    assert sent_cap(decider, snap, keys.acme, chat(max_tokens=2000)) == 2000
    assert sent_cap(decider, snap, keys.acme, chat(max_completion_tokens=3000)) == 3000
    assert sent_cap(decider, snap, keys.acme, chat(max_tokens=9000)) == 4096
    assert sent_cap(decider, snap, keys.acme, chat(max_tokens=100)) == 100


def test_the_default_cap_fits_the_tenants_smallest_token_limit(
    tenants_file: Path, keys: Keys
) -> None:
    """A cap above every token limit the tenant has would make each SDK-default request too
    large to ever be admitted: prompt + cap stay within the smallest (a 300-token budget)."""
    table = TIERS.model_copy(update={"tenants": {"globex": TenantSpec(budget=Budget(tokens=300))}})
    d = allowed(
        make_decider().decide(
            tenants.load(tenants_file, table), bearer(keys.globex, **GENERATION), chat(), NOW_S
        )
    )
    assert metadata(d)[wire.META_TOKEN_ESTIMATE] == "300"
    assert 0 < float(metadata(d)[wire.META_MAX_OUTPUT]) < 300  # type: ignore[arg-type]


def test_embeddings_reserve_no_output_and_get_no_cap(
    decider: Decider, snap: Snapshot, keys: Keys
) -> None:
    body = json.dumps({"model": "llama-3-8b", "input": "x" * 400, "max_tokens": 9}).encode()
    headers = bearer(keys.acme, **{":path": wire.EMBEDDINGS_PATH, ":method": "POST"})
    d = allowed(decider.decide(snap, headers, body, NOW_S))
    assert metadata(d)[wire.META_TOKEN_ESTIMATE] == "100"
    assert "max_tokens" not in str(metadata(d)[wire.META_BODY_SUFFIX])  # vLLM would warn of it


def test_session_minted_then_continued(decider: Decider, snap: Snapshot, keys: Keys) -> None:
    first = allowed(decider.decide(snap, bearer(keys.acme), chat(), NOW_S))
    again = allowed(
        decider.decide(
            snap, bearer(keys.acme, **{"x-session-id": first.context.session}), chat(), NOW_S + 5
        )
    )
    assert again.context.session == first.context.session
    other = allowed(decider.decide(snap, bearer(keys.acme), chat(), NOW_S))
    assert other.context.session != first.context.session


@pytest.mark.parametrize("bad", ["sess_nope", "garbage", "x" * 30, "other-tenant", "expired"])
def test_invalid_session_is_400(decider: Decider, snap: Snapshot, keys: Keys, bad: str) -> None:
    now = NOW_S
    if bad == "other-tenant":
        bad = allowed(decider.decide(snap, {"api-key": keys.globex}, b"", NOW_S)).context.session
    elif bad == "expired":
        bad = allowed(decider.decide(snap, bearer(keys.acme), b"", NOW_S)).context.session
        now = NOW_S + 3601  # the fixture's max age is one hour
    d = decider.decide(snap, bearer(keys.acme, **{"x-session-id": bad}), chat(), now)
    denied(d, 400, "invalid_session_id")


def test_sessions_signed_by_another_deployment_are_rejected(snap: Snapshot, keys: Keys) -> None:
    from extauthz.sessions import SessionCodec, Sessions

    mine = make_decider()
    theirs = Decider(mine.settings, Sessions(SessionCodec(SECRET[::-1] + b"!"), worker_id=1))
    foreign = allowed(theirs.decide(snap, bearer(keys.acme), b"", NOW_S)).context.session
    d = mine.decide(snap, bearer(keys.acme, **{"x-session-id": foreign}), b"", NOW_S)
    denied(d, 400, "invalid_session_id")


def test_the_tenant_priority_reaches_vllm_and_replaces_the_clients(
    decider: Decider, snap: Snapshot, keys: Keys
) -> None:
    client = {wire.HEADER_VLLM_PRIORITY: "-100"}
    acme = allowed(decider.decide(snap, bearer(keys.acme, **client), chat(priority=-9), NOW_S))
    globex = allowed(decider.decide(snap, {"api-key": keys.globex, **client}, b"", NOW_S))
    # acme is priority 5, globex 8: vLLM serves lower numbers first, so globex goes first.
    assert dict(acme.headers)[wire.HEADER_VLLM_PRIORITY] == "5"
    assert dict(globex.headers)[wire.HEADER_VLLM_PRIORITY] == "2"
    # Set with OVERWRITE (extauthz/service.py), so the client's copy is replaced, not appended.
    assert [v for k, v in acme.headers if k == wire.HEADER_VLLM_PRIORITY] == ["5"]


def test_with_engine_priority_off_every_request_gets_vllms_default(
    snap: Snapshot, keys: Keys
) -> None:
    off = make_decider(engine_priority=False)
    forged = bearer(keys.acme, **{wire.HEADER_VLLM_PRIORITY: "-100"})
    d = allowed(off.decide(snap, forged, chat(priority=-9), NOW_S))
    assert dict(d.headers)[wire.HEADER_VLLM_PRIORITY] == "0"


GENERATION = {":path": "/v1/chat/completions", ":method": "POST"}


@pytest.mark.parametrize(
    ("body", "headers", "status", "code"),
    [
        (b"{not json", {}, 400, "invalid_json"),
        (b"[1, 2]", {}, 400, "invalid_json"),
        (b"", {}, 400, "invalid_json"),
        # UTF-8 only: json.loads alone reads UTF-16 and UTF-32 (by BOM or by its zero bytes).
        (chat().decode().encode("utf-16"), {}, 400, "invalid_json"),
        (chat().decode().encode("utf-32-le"), {}, 400, "invalid_json"),
        (b"\xef\xbb\xbf" + chat(), {}, 400, "invalid_json"),  # UTF-8's BOM
        (
            chat(content="\udcff").replace(b"\\udcff", b"\xed\xb3\xbf"),
            {},
            400,
            "invalid_json",
        ),  # a lone surrogate
        (json.dumps({"messages": []}).encode(), {}, 400, "missing_model"),
        (json.dumps({"model": ["m"], "messages": []}).encode(), {}, 400, "missing_model"),
        (chat(), {"content-encoding": "gzip"}, 415, "unsupported_content_encoding"),
        (chat(), {"content-encoding": "br"}, 415, "unsupported_content_encoding"),
    ],
)
def test_generation_bodies_the_pod_would_read_otherwise_are_refused(
    decider: Decider, snap: Snapshot, keys: Keys, body: bytes, headers: dict[str, str],
    status: int, code: str,
) -> None:  # fmt: skip
    # globex may use any model: a missing one would still reach the pod's default model.
    request_headers = {**bearer(keys.globex), **GENERATION, **headers}
    d = denied(decider.decide(snap, request_headers, body, NOW_S), status, code)
    assert d.tenant is not None


def test_a_valid_generation_body_and_other_paths_pass(
    decider: Decider, snap: Snapshot, keys: Keys
) -> None:
    allowed(decider.decide(snap, {**bearer(keys.globex), **GENERATION}, chat("any"), NOW_S))
    identity = {**bearer(keys.globex), **GENERATION, "content-encoding": "identity"}
    allowed(decider.decide(snap, identity, chat("any"), NOW_S))
    models = {**bearer(keys.globex), ":path": "/v1/models?x=1", ":method": "GET"}
    allowed(decider.decide(snap, models, b"", NOW_S))


async def test_a_body_read_in_the_pool_decides_exactly_as_inline(
    decider: Decider, snap: Snapshot, keys: Keys
) -> None:
    """Large bodies are read in a worker process (off the event loop); the decision must not
    depend on where the body was read."""
    from extauthz.bodypool import BodyPool

    pool = BodyPool(decider, from_bytes=1)
    try:
        await pool.start()
        headers = {**bearer(keys.acme, **{"x-request-id": "r-1"}), **GENERATION}
        for body in (
            chat(max_tokens=50),
            chat("gpt-4"),
            b"{bad",
            json.dumps({"messages": []}).encode(),
        ):
            pooled = await pool.read(body, wire.CHAT_PATH)
            assert pooled is not None
            inline = decider.decide(snap, headers, body, NOW_S)
            again = decider.decide(snap, headers, body, NOW_S, pooled)
            if isinstance(inline, Allow):
                assert isinstance(again, Allow)
                assert {**metadata(inline), wire.META_SESSION: ""} == {
                    **metadata(again),
                    wire.META_SESSION: "",
                }
            else:
                assert again == inline
        inline_pool = BodyPool(decider, from_bytes=10**9)
        assert await inline_pool.read(chat(), wire.CHAT_PATH) is None  # small: inline
    finally:
        await pool.close()


RESPONSES = {":path": wire.RESPONSES_PATH, ":method": "POST"}


def responses(model: str = "llama-3-8b", **fields: object) -> bytes:
    return json.dumps({"model": model, "input": "x" * 400, **fields}).encode()


def test_a_responses_request_is_counted_and_capped_as_the_chat_vllm_renders_it_into(
    decider: Decider, snap: Snapshot, keys: Keys
) -> None:
    """Its input and instructions are the messages vLLM renders: the same prompt, the same
    reservation, routed alike; the cap goes under max_output_tokens, the name the pod reads."""
    headers = bearer(keys.acme, **RESPONSES)
    as_responses = allowed(
        decider.decide(snap, headers, responses(instructions="be brief", stream=True), NOW_S)
    )
    as_chat = allowed(
        decider.decide(
            snap,
            bearer(keys.acme, **GENERATION),
            json.dumps(
                {
                    "model": "llama-3-8b",
                    "messages": [
                        {"role": "system", "content": "be brief"},
                        {"role": "user", "content": "x" * 400},
                    ],
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
            ).encode(),
            NOW_S,
        )
    )
    assert as_responses.facts.prompt_tokens == as_chat.facts.prompt_tokens > 100
    assert as_responses.facts.token_estimate == as_chat.facts.token_estimate
    assert as_responses.facts.prefix_blocks == as_chat.facts.prefix_blocks != ()
    # Its usage always ends the stream: the gateway strips none of it.
    assert as_responses.facts.stream and as_responses.facts.include_usage
    sent = as_the_pod_reads_it(
        responses(max_output_tokens=9000),
        allowed(decider.decide(snap, headers, responses(max_output_tokens=9000), NOW_S)),
    )
    assert sent["max_output_tokens"] == 4096 and "max_tokens" not in sent
    assert sent["store"] is False  # no pod keeps a response, whatever its own setting
    named = responses(max_output_tokens=70)
    assert (
        as_the_pod_reads_it(named, allowed(decider.decide(snap, headers, named, NOW_S)))[
            "max_output_tokens"
        ]
        == 70
    )


BIG = 2_000  # the test decider reads bodies of up to 10,000 bytes


@pytest.mark.parametrize(
    "item",
    [
        {"role": "user", "content": [{"type": "input_text", "text": "a" * BIG}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "d" * BIG}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "b" * BIG},
        # vLLM renders a custom call's input, and a call's name under its namespace.
        {"type": "custom_tool_call", "call_id": "c", "name": "f", "input": "i" * BIG},
        {"type": "function_call", "call_id": "c", "name": "f", "namespace": "n" * BIG},
        {"type": "function_call_output", "call_id": "c1", "output": "c" * BIG},
        {"type": "function_call_output", "output": [{"type": "input_text", "text": "o" * BIG}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "r" * BIG}]},
        {"type": "made_up", "payload": "e" * BIG},  # vLLM refuses it: counted all the same
    ],
)
def test_every_input_item_vllm_renders_is_counted_in_full(
    decider: Decider, snap: Snapshot, keys: Keys, item: dict[str, object]
) -> None:
    """The reservation and the bound a stream cut short is charged hold all of an item's text,
    whatever the item's kind or the member vLLM reads it from."""
    body = responses(input=[{"role": "user", "content": "hi"}, item])
    d = allowed(decider.decide(snap, bearer(keys.acme, **RESPONSES), body, NOW_S))
    assert d.facts.prompt_tokens >= BIG // 4
    assert d.facts.prompt_bound >= BIG


def test_a_custom_calls_input_is_counted_not_a_decoy(
    decider: Decider, snap: Snapshot, keys: Keys
) -> None:
    call = {"type": "custom_tool_call", "call_id": "c", "name": "f", "input": "i" * BIG}
    decoy = {**call, "arguments": "x"}  # vLLM renders `input` whatever else the item says
    d = allowed(
        decider.decide(snap, bearer(keys.acme, **RESPONSES), responses(input=[decoy]), NOW_S)
    )
    assert d.facts.prompt_bound >= BIG


def test_an_image_in_a_tool_output_counts_as_an_image(
    decider: Decider, snap: Snapshot, keys: Keys
) -> None:
    image = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}
    plain = {"type": "function_call_output", "call_id": "c", "output": "x"}
    pictured = {**plain, "output": [image]}
    facts = [
        allowed(
            decider.decide(snap, bearer(keys.acme, **RESPONSES), responses(input=[i]), NOW_S)
        ).facts
        for i in (plain, pictured)
    ]
    assert facts[1].prompt_tokens >= facts[0].prompt_tokens + decider.settings.image_tokens - 1


def test_an_assistant_item_makes_a_later_turn(decider: Decider, snap: Snapshot, keys: Keys) -> None:
    items = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    d = allowed(decider.decide(snap, bearer(keys.acme, **RESPONSES), responses(input=items), NOW_S))
    assert not d.facts.first_turn  # a pod may hold this conversation


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"store": True}, "store"),
        ({"store": "true"}, "store"),
        ({"background": True}, "background"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ],
)
def test_a_responses_request_that_needs_a_stored_response_is_refused(
    decider: Decider, snap: Snapshot, keys: Keys, fields: dict[str, object], param: str
) -> None:
    """The gateway keeps no responses: what would need one is a clear 400, never a pod's
    silent `store` off or a previous response on a pod the request does not reach."""
    decision = decider.decide(snap, bearer(keys.acme, **RESPONSES), responses(**fields), NOW_S)
    refused = denied(decision, 400, "unsupported_parameter")
    assert refused.param == param and "keeps no responses" in refused.message
    # Stateless requests, the SDK's default (`store` omitted) or false, are served.
    for stateless in ({}, {"store": False, "background": False, "previous_response_id": None}):
        allowed(decider.decide(snap, bearer(keys.acme, **RESPONSES), responses(**stateless), NOW_S))


def store_decider() -> Decider:
    return make_decider(
        max_body_bytes=10_000, responses_store=True, max_model_len={"llama-3-8b": 8192}
    )


@pytest.mark.parametrize(
    ("fields", "stores"), [({}, True), ({"store": True}, True), ({"store": False}, False)]
)
def test_with_the_store_on_a_response_is_stored_unless_told_not_to(
    snap: Snapshot, keys: Keys, fields: dict[str, object], stores: bool
) -> None:
    """vLLM's default, `store` true, kept; until a pod is chosen (its ID names the pod) the
    body still says "store": false, so that a request no pod was chosen for stores nothing."""
    d = allowed(
        store_decider().decide(snap, bearer(keys.acme, **RESPONSES), responses(**fields), NOW_S)
    )
    assert d.stores is stores and d.pinned is None
    assert d.body_suffix is not None and d.body_suffix.endswith('"store": false')


def test_with_the_store_on_background_stays_refused(snap: Snapshot, keys: Keys) -> None:
    """A background response's usage never passes through the gateway: it would run unmetered."""
    decision = store_decider().decide(
        snap, bearer(keys.acme, **RESPONSES), responses(background=True), NOW_S
    )
    assert denied(decision, 400, "unsupported_parameter").param == "background"


@pytest.mark.parametrize(("bound", "history"), [(1_000, 1_000), (10**6, None)])
def test_a_follow_up_goes_to_the_pod_of_its_previous_response_reserved_for_its_history(
    snap: Snapshot, keys: Keys, bound: int, history: int | None
) -> None:
    """The pod puts the stored conversation before the input: reserved as the most the
    previous response's ID says it can be, within what the context leaves; never charged as
    the request's own prompt (the ledger charges that), so a follow-up cut short pays its
    input, not the context."""
    decider = store_decider()
    previous = decider.response_ids.mint("acme", Kept("127.0.0.1:9001", bound))
    alone = allowed(decider.decide(snap, bearer(keys.acme, **RESPONSES), responses(), NOW_S))
    d = allowed(
        decider.decide(
            snap, bearer(keys.acme, **RESPONSES), responses(previous_response_id=previous), NOW_S
        )
    )
    assert d.pinned == "127.0.0.1:9001" and d.stores
    facts = d.facts
    assert (facts.prompt_tokens, facts.max_output) == (
        alone.facts.prompt_tokens,
        alone.facts.max_output,
    )
    room = 8192 - facts.prompt_tokens - facts.max_output
    assert facts.history == (room if history is None else history)
    assert facts.token_estimate == alone.facts.token_estimate + facts.history
    meta = facts.to_metadata()  # what the admission reserves and prices beside the cap
    assert meta[wire.META_TOKEN_PROMPT] == str(facts.history + facts.prompt_tokens)
    assert meta[wire.META_TOKEN_CEILING] == str(facts.history + facts.prompt_ceiling)
    assert meta[wire.META_PROMPT_ESTIMATE] == float(facts.prompt_tokens)  # what is charged
    # Its own response is stored: Envoy must not move it to another pod than its ID names.
    assert (wire.HEADER_MAX_RETRIES, "0") in d.headers
    assert (wire.HEADER_MAX_RETRIES, "0") in alone.headers  # stored too (vLLM's default)
    unkept = decider.decide(snap, bearer(keys.acme, **RESPONSES), responses(store=False), NOW_S)
    assert wire.HEADER_MAX_RETRIES not in dict(allowed(unkept).headers)  # Envoy's retries kept


def test_a_stored_response_is_not_streamed_again(snap: Snapshot, keys: Keys) -> None:
    """vLLM replays only background responses (for others its stream breaks after the 200)."""
    decider = store_decider()
    rid = decider.response_ids.mint("acme", Kept("127.0.0.1:9001", 10))
    for query in ("stream=true", "starting_after=3", "stream=false&x=1"):
        path = {":path": f"{wire.RESPONSES_PATH}/{rid}?{query}", ":method": "GET"}
        decision = decider.decide(snap, bearer(keys.acme, **path), b"", NOW_S)
        assert denied(decision, 400, "unsupported_parameter").param in ("stream", "starting_after")
    plain = {":path": f"{wire.RESPONSES_PATH}/{rid}?x=1", ":method": "GET"}
    assert allowed(decider.decide(snap, bearer(keys.acme, **plain), b"", NOW_S)).pinned


@pytest.mark.parametrize("who", ["another tenant's", "forged", "not a string"])
def test_a_previous_response_this_tenant_was_not_given_is_not_found(
    snap: Snapshot, keys: Keys, who: str
) -> None:
    decider = store_decider()
    theirs = decider.response_ids.mint(tenants_of(snap, keys.globex), Kept("127.0.0.1:9001", 10))
    named: object = {
        "another tenant's": theirs,
        "forged": decider.response_ids.mint("acme", Kept("127.0.0.1:9001", 10))[:-2] + "AA",
        "not a string": 12,
    }[who]
    decision = decider.decide(
        snap, bearer(keys.acme, **RESPONSES), responses(previous_response_id=named), NOW_S
    )
    refused = denied(decision, 404, "response_not_found")
    assert refused.param == "previous_response_id"


def tenants_of(snap: Snapshot, key: str) -> str:
    return allowed(make_decider().decide(snap, bearer(key, **RESPONSES), responses(), NOW_S)).tenant


@pytest.mark.parametrize(("method", "tail"), [("GET", ""), ("POST", "/cancel")])
def test_a_stored_response_is_read_or_cancelled_only_by_its_tenant_at_its_pod(
    snap: Snapshot, keys: Keys, method: str, tail: str
) -> None:
    decider = store_decider()
    rid = decider.response_ids.mint("acme", Kept("127.0.0.1:9001", 10))
    path = {":path": f"{wire.RESPONSES_PATH}/{rid}{tail}", ":method": method}
    d = allowed(decider.decide(snap, bearer(keys.acme, **path), b"", NOW_S))
    assert d.pinned == "127.0.0.1:9001" and not d.stores and d.facts.token_estimate == 0
    refused = denied(
        decider.decide(snap, bearer(keys.globex, **path), b"", NOW_S), 404, "response_not_found"
    )
    assert refused.param == "response_id" and rid[:20] in refused.message
    # The store off: the gateway says it keeps none.
    off = denied(
        make_decider().decide(snap, bearer(keys.acme, **path), b"", NOW_S),
        404,
        "response_not_found",
    )
    assert "keeps no responses" in off.message
    # A stranger's answer is the key's, before anything about the ID.
    denied(decider.decide(snap, bearer("sk-nope", **path), b"", NOW_S), 401, "invalid_api_key")


def test_the_paths_of_stored_responses() -> None:
    assert wire.response_id("/v1/responses/resp_a") == "resp_a"
    assert wire.response_id("/v1/responses/resp_a/cancel") == "resp_a"
    for path in ("/v1/responses", "/v1/responses/", "/v1/responses/a/b", "/v1/responses//cancel"):
        assert wire.response_id(path) is None
    assert wire.endpoint("/v1/responses/resp_a") == "/v1/responses/{id}"
    assert wire.endpoint("/v1/responses/resp_a/cancel") == "/v1/responses/{id}/cancel"
    assert wire.endpoint(wire.CHAT_PATH) == wire.CHAT_PATH
    assert wire.endpoint("/v1/models/some/model") == "/v1/models/{id}"
