"""The decision: who is calling, may they make this request, and which session it belongs to.

Deterministic given the snapshot, the request and the time, except that minting a session advances
the replica's Snowflake sequence and a missing `x-request-id` is filled with a random UUID.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import uuid
from collections.abc import Mapping
from urllib.parse import parse_qs

from extauthz.body import Body
from extauthz.body import read as read_body
from extauthz.responseids import Kept, ResponseIds
from extauthz.sessions import Sessions
from extauthz.settings import DecisionSettings
from extauthz.tenants import digest
from extauthz.types import KEY_PREFIX, Allow, Decision, Deny, KeyEntry, Snapshot, TenantView
from llmgw import facts, priority, wire
from llmgw.facts import RequestFacts
from llmgw.fleetload import ModelContexts
from llmgw.tenant import TenantContext

_MAX_KEY_CHARS = 256
_STRIP = ("authorization", "api-key", wire.DESTINATION_ENDPOINT)

MISSING_KEY = Deny(
    401,
    "invalid_api_key",
    "You didn't provide an API key. Send it as 'Authorization: Bearer KEY' or 'api-key: KEY'.",
)
BAD_KEY = Deny(401, "invalid_api_key", "Incorrect API key provided.")
_NO_FACTS = facts.RequestFacts()  # of a body that is not a JSON object


def _api_key(headers: Mapping[str, str]) -> str | None:
    """The presented key, "" when malformed, None when absent."""
    auth = headers.get("authorization")
    if auth is not None:
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer":
            return token.strip()
    key = headers.get("api-key")
    if key is not None:
        return key.strip()
    return None if auth is None else ""


class Decider:
    def __init__(
        self,
        settings: DecisionSettings,
        sessions: Sessions,
        cache_secret: bytes = b"",
        contexts: ModelContexts | None = None,
        response_ids: ResponseIds | None = None,
    ) -> None:
        """`contexts`: the fleet's (the router's datastore, or the fleet load its rate limiter
        reads); None: only the operator's `max_model_len`. `response_ids`: the stored
        responses' (by default keyed by `cache_secret`, the sessions' secret)."""
        self.settings = settings
        self.sessions = sessions
        self.cache_secret = cache_secret
        self.contexts = contexts
        self.response_ids = response_ids or ResponseIds(cache_secret)
        self._salts: dict[str, str] = {}

    def cache_salt(self, group: str) -> str:
        """vLLM's `cache_salt` for a cache group: requests share prefix-cache blocks on a pod
        only with the same salt. Keyed by a server secret, so no client can compute another
        group's salt."""
        salt = self._salts.get(group)
        if salt is None:
            mac = hmac.new(self.cache_secret, b"llmgw-cache-salt\0" + group.encode(), "sha256")
            salt = self._salts[group] = mac.hexdigest()[:32]
        return salt

    def _engine_priority(self, tenant_priority: int) -> int:
        """vLLM's `priority` for the pod: the tenant's, or vLLM's default when switched off."""
        if not self.settings.engine_priority:
            return priority.NEUTRAL
        return priority.vllm_priority(tenant_priority)

    def read(self, body: bytes, path: str) -> Body:
        """The body of a request to `path` as the decision needs it (picklable: large ones are
        read in a pool)."""
        return read_body(body, self.settings, path)

    def decide(
        self,
        snapshot: Snapshot,
        headers: Mapping[str, str],
        body: bytes,
        now: float,
        parsed: Body | None = None,
    ) -> Decision:
        """`headers` have lower-case names (as Envoy sends them); `now` is Unix seconds;
        `parsed` is `self.read(body, path)` when the caller read the body already."""
        entry = key_entry(snapshot, headers, now)
        if isinstance(entry, Deny):
            return entry
        tenant = entry.tenant
        path = request_path(headers)
        read = self._body(headers, body, parsed, path, tenant.id)
        if isinstance(read, Deny):
            return read
        storage = self._storage(read, headers.get(":path", ""), tenant.id)
        if isinstance(storage, Deny):
            return storage
        request_facts = self._facts(read, path, tenant)
        if isinstance(request_facts, Deny):
            return request_facts
        if storage.continues is not None and read.kind == "object":
            request_facts = self._with_history(request_facts, storage.continues)
        session = self._session(headers, tenant.id, int(now * 1000))
        if isinstance(session, Deny):
            return session
        context = TenantContext(
            tenant=tenant.id,
            tier=tenant.tier,
            priority=tenant.priority,
            session=session,
            request_id=headers.get(wire.HEADER_REQUEST_ID) or str(uuid.uuid4()),
            key_id=entry.key_id,
            own=tenant.own,
        )
        set_headers = self._headers(tenant, context, request_facts, storage.stores)
        return Allow(
            context,
            request_facts,
            set_headers,
            _removed(headers, set_headers),
            ((wire.HEADER_SESSION, session),),
            body_suffix=self._suffix(
                read, path, tenant.cache_group, context.request_id, request_facts.max_output
            ),
            allowed_models=_allowed_models(read, path, tenant),
            pinned=None if storage.continues is None else storage.continues.pod,
            stores=storage.stores,
        )

    def _body(
        self, headers: Mapping[str, str], body: bytes, parsed: Body | None, path: str, tenant: str
    ) -> Body | Deny:
        """The body read, unless it is too large to read, or one the gateway refuses."""
        limit = self.settings.max_body_bytes
        declared = headers.get("content-length", "")
        if (
            len(body) > limit
            or headers.get(wire.HEADER_PARTIAL_BODY) == "true"
            or (declared.isdigit() and int(declared) > limit)
        ):
            return Deny(
                413,
                "request_too_large",
                f"The request body exceeds the limit of {limit} bytes.",
                tenant=tenant,
            )
        read = parsed or self.read(body, path)
        if read.kind == "too_deep":
            return Deny(
                400,
                "invalid_json",
                "The request body nests JSON too deeply to be parsed.",
                tenant=tenant,
            )
        if path in wire.GENERATION_PATHS:
            # Decided here, before any pod or quota sees the request, so that what the gateway
            # counts and routes is what the pod will do, and bad input is never charged.
            refused = _refuse_body(headers, read, tenant)
            if refused is not None:
                return refused
        return read

    def _storage(self, read: Body, target: str, tenant: str) -> Storage | Deny:
        """What the request asks of the store of responses (`target`: its path and query): the
        stored response it reads, cancels or continues (its path's, or its
        `previous_response_id`), and whether its own response is stored; or the refusal."""
        path, _, query = target.partition("?")
        named = wire.response_id(path)
        if not self.settings.responses_store:
            if named is not None:
                return _not_found(named, tenant, "This gateway keeps no responses: ")
            if read.stateful is not None:
                return Deny(
                    400,
                    "unsupported_parameter",
                    f"This gateway keeps no responses: {read.stateful!r} is not supported. "
                    "Send the conversation's items in 'input' instead, with 'store' false or "
                    "omitted.",
                    param=read.stateful,
                    tenant=tenant,
                )
            return _STATELESS
        if named is not None:
            replayed = next((p for p in _REPLAYS if p in parse_qs(query)), None)
            if replayed is not None:
                # vLLM replays only background responses' events: for any other it fails once
                # its 200 is sent (a broken stream), and the gateway runs none in the background.
                return Deny(
                    400,
                    "unsupported_parameter",
                    f"{replayed!r}: this gateway runs no responses in the background, so none "
                    "can be streamed again. Read it whole.",
                    param=replayed,
                    tenant=tenant,
                )
            kept = self.response_ids.kept(tenant, named)
            return _not_found(named, tenant) if kept is None else Storage(kept, False)
        if path != wire.RESPONSES_PATH:
            return _STATELESS
        if read.background:
            # Its usage would never pass through the gateway: unmetered, unpriced.
            return Deny(
                400,
                "unsupported_parameter",
                "This gateway does not run responses in the background: send the request "
                "without 'background' (stream it to follow its progress).",
                param="background",
                tenant=tenant,
            )
        stores = read.store is not False  # vLLM stores unless told not to
        if read.previous is None:
            return Storage(None, stores)
        kept = self.response_ids.kept(tenant, read.previous)
        if kept is None:
            return _not_found(read.previous, tenant, param="previous_response_id")
        return Storage(kept, stores)

    def _with_history(self, request_facts: RequestFacts, kept: Kept) -> RequestFacts:
        """A request that continues a stored response: the pod puts the stored conversation
        before its input, which the gateway never sees; reserved as the most it can be (what
        its ID says, within what the model's context leaves beside the input and the cap), and
        settled at what the pod reports."""
        history = kept.tokens
        context = self._context(request_facts.model)
        if context is not None:
            room = context - request_facts.prompt_tokens - request_facts.max_output
            history = max(0, min(history, room))
        return dataclasses.replace(request_facts, history=history)

    def _facts(self, read: Body, path: str, tenant: TenantView) -> RequestFacts | Deny:
        """The request facts as the tenant may have them, or the refusal of its model."""
        if read.kind != "object":
            return _NO_FACTS
        if tenant.models is not None and read.has_model and read.model not in tenant.models:
            return Deny(
                403,
                "model_not_allowed",
                f"The model {read.model_shown} is not available to tenant {tenant.id!r}.",
                param="model",
                tenant=tenant.id,
            )
        # The output cap per sequence the pod gets (appended to the body: `_suffix`): the
        # reservation holds what the pod may generate, whatever the client named. A cap the
        # gateway chooses stays within the model's context, which vLLM would refuse it above
        # (and itself lowers to what fits beside the prompt): a request vLLM would serve is
        # served. A cap the client names is vLLM's to refuse, as it would without the gateway.
        cap = 0
        if path != wire.EMBEDDINGS_PATH:
            context = None if read.cap_named else self._context(read.facts.model)
            cap = self.settings.output_cap(tenant, read.facts, context)
        salt = self.cache_salt(tenant.cache_group)
        return read.for_tenant(tenant.cache_group, salt, self.settings, cap)

    def _context(self, model: str | None) -> int | None:
        """The model's context: the least of the fleet's and the operator's; None: unknown."""
        if model is None:
            return None
        fleet = None if self.contexts is None else self.contexts.context(model)
        known = [c for c in (fleet, self.settings.max_model_len.get(model)) if c is not None]
        return min(known, default=None)

    def _session(self, headers: Mapping[str, str], tenant: str, now_ms: int) -> str | Deny:
        """The client's session if it is this tenant's and unexpired; a new one if none."""
        session = headers.get(wire.HEADER_SESSION, "")
        if not session:
            return self.sessions.mint(tenant, now_ms)
        if self.sessions.verify(tenant, session, now_ms):
            return session
        return Deny(
            400,
            "invalid_session_id",
            "The X-Session-ID header is not a valid, unexpired session of this tenant. "
            "Omit it to start a new session.",
            param="x-session-id",
            tenant=tenant,
        )

    def _headers(
        self,
        tenant: TenantView,
        context: TenantContext,
        request_facts: RequestFacts,
        stores: bool = False,
    ) -> tuple[tuple[str, str], ...]:
        """The headers set on the request to the pod (`stores`: its response is stored)."""
        set_headers = (
            *tenant.headers,
            # Replaces a client's header; overrides the body's `priority` in vLLM.
            (wire.HEADER_VLLM_PRIORITY, str(self._engine_priority(tenant.priority))),
            (wire.HEADER_TOKEN_ESTIMATE, str(request_facts.token_estimate)),
            (wire.HEADER_SESSION, context.session),
            (wire.HEADER_REQUEST_ID, context.request_id),
        )
        if request_facts.model is not None:
            set_headers = (*set_headers, (wire.HEADER_MODEL, request_facts.model))
        if stores:
            # Its ID names the pod chosen for it: Envoy retrying it on another pod would store
            # it where its ID does not lead. The client gets the pod's answer, and may send again.
            set_headers = (*set_headers, (wire.HEADER_MAX_RETRIES, "0"))
        return set_headers

    def _suffix(
        self, read: Body, path: str, cache_group: str, request_id: str, cap: int
    ) -> str | None:
        """Fields the pod must get from the gateway, whatever the client sent: appended to the
        JSON object by Envoy (envoy/rewrite.lua), where they win (the pod's JSON parser, like
        this one, keeps the last of duplicate keys): the cache salt, the request ID and the
        output cap per sequence. None: the body is no JSON object.

        Spelled as json.dumps spells the members, at a fraction of its cost: the salt is hex and
        the caps are ints, so nothing needs escaping. vLLM names the engine's request after the
        X-Request-Id header (Envoy's), else the body's `request_id`: ours either way, never a
        client's (one in flight under that id would collide)."""
        if read.kind != "object":
            return None
        suffix = f'"cache_salt": "{self.cache_salt(cache_group)}"'
        suffix += f', "request_id": {json.dumps(request_id)}'
        if path == wire.RESPONSES_PATH:
            # vLLM stores every response unless told not to, when its pod runs with the store on
            # (VLLM_ENABLE_RESPONSES_API_STORE): the gateway keeps none, so no pod may either.
            suffix += f', "max_output_tokens": {cap}, "store": false'
        elif path != wire.EMBEDDINGS_PATH:
            suffix += f', "max_tokens": {cap}'
            if path == wire.CHAT_PATH and read.completion_cap:
                # vLLM's chat reads this one first; named only to replace the client's, so
                # that a cap vLLM refuses is refused under the name the client used.
                suffix += f', "max_completion_tokens": {cap}'
        return suffix if read.empty else f",{suffix}"


def request_path(headers: Mapping[str, str]) -> str:
    """The request's path without its query string."""
    return headers.get(":path", "").partition("?")[0]


def key_entry(snapshot: Snapshot, headers: Mapping[str, str], now: float) -> KeyEntry | Deny:
    """The presented key's entry, or its refusal: the one reading of a key from the headers
    (Envoy's filter at the request's headers asks this too: extauthz/httpserver.py)."""
    api_key = _api_key(headers)
    if api_key is None:
        return MISSING_KEY
    if not api_key.startswith(KEY_PREFIX) or len(api_key) > _MAX_KEY_CHARS:
        return BAD_KEY
    presented = digest(api_key)
    entry = snapshot.keys.get(presented)
    if entry is None or entry.revoked or (entry.expires is not None and now >= entry.expires):
        return BAD_KEY
    return entry


@dataclasses.dataclass(frozen=True, slots=True)
class Storage:
    """What a request asks of the store of responses."""

    continues: Kept | None  # the stored response it reads, cancels or continues
    stores: bool  # its own response is stored (under an ID chosen at the pick)


_STATELESS = Storage(None, False)
# GET /v1/responses/{id}'s parameters that replay a background response's events.
_REPLAYS = ("stream", "starting_after")


def _not_found(named: str, tenant: str, why: str = "", param: str = "response_id") -> Deny:
    """vLLM's answer for a response it does not hold, for one this tenant may not read: another
    tenant's ID, a changed or made-up one (the gateway answers, no pod is asked)."""
    return Deny(
        404,
        "response_not_found",
        f"{why}Response with id {named[:200]!r} not found.",
        param=param,
        tenant=tenant,
    )


def _refuse_body(headers: Mapping[str, str], read: Body, tenant: str) -> Deny | None:
    """A generation request the gateway refuses as it stands, or None."""
    encoding = headers.get("content-encoding", "identity").strip().lower()
    if encoding != "identity":
        # The gateway reads the body to authorize, count and route it: it must read what the
        # pod would decode.
        return Deny(
            415,
            "unsupported_content_encoding",
            f"Content-Encoding {encoding!r} is not supported: send the JSON body uncompressed.",
            param="content-encoding",
            tenant=tenant,
        )
    if read.kind != "object":
        return Deny(
            400,
            "invalid_json",
            "We could not parse the JSON body of your request. The API expects a JSON object "
            "with the request's parameters.",
            tenant=tenant,
        )
    if not read.model_text:
        # Without it the pod would serve its default model, whatever the tenant may use.
        return Deny(
            400,
            "missing_model",
            "You must provide a model parameter.",
            param="model",
            tenant=tenant,
        )
    return None


def _removed(
    headers: Mapping[str, str], set_headers: tuple[tuple[str, str], ...]
) -> tuple[str, ...]:
    """The client's headers removed: its key, a destination it names, and every x-llmgw-* name
    not set now, so that no forged one survives."""
    ours = {name for name, _ in set_headers}
    return tuple(
        name
        for name in headers
        if name in _STRIP or (name.startswith(wire.HEADER_PREFIX) and name not in ours)
    )


def _allowed_models(read: Body, path: str, tenant: TenantView) -> str | None:
    """The model list the client sees is its allow-list's part (envoy/rewrite.lua); None: all."""
    if read.kind == "object" or tenant.models is None or not path.startswith(wire.MODELS_PATH):
        return None
    return " ".join(sorted(tenant.models))
