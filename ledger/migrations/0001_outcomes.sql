-- One row per request: llmgw.outcome.Outcome, column for field. Idempotent by request ID.
CREATE TABLE outcomes (
    request_id        text PRIMARY KEY,
    ts                timestamptz NOT NULL,
    tenant            text NOT NULL,
    tier              text NOT NULL DEFAULT '',
    session           text NOT NULL DEFAULT '',
    key_id            text NOT NULL DEFAULT '',
    model             text NOT NULL DEFAULT '',
    endpoint          text NOT NULL DEFAULT '',
    pod               text NOT NULL DEFAULT '',
    status            integer NOT NULL,
    flags             text NOT NULL DEFAULT '',
    attempts          integer NOT NULL DEFAULT 0,
    stream            boolean NOT NULL DEFAULT false,
    outcome           text NOT NULL
                      CHECK (outcome IN ('ok', 'aborted', 'upstream_error', 'refused')),
    prompt_tokens     bigint NOT NULL DEFAULT 0,
    completion_tokens bigint NOT NULL DEFAULT 0,
    cached_tokens     bigint NOT NULL DEFAULT 0,
    reserved_tokens   bigint NOT NULL DEFAULT 0,
    charged_tokens    bigint NOT NULL DEFAULT 0,
    ttft_ms           double precision,
    duration_ms       double precision NOT NULL DEFAULT 0,
    bytes_in          bigint NOT NULL DEFAULT 0,
    bytes_out         bigint NOT NULL DEFAULT 0,
    written_at        timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX outcomes_ts ON outcomes (ts);
CREATE INDEX outcomes_tenant_ts ON outcomes (tenant, ts);
CREATE INDEX outcomes_session_ts ON outcomes (session, ts) WHERE session <> '';

-- Things that happened to a tenant or the fleet rather than to one request: breaker trips and
-- recoveries, alerts. `detail` is free-form per kind.
CREATE TABLE ledger_events (
    id     bigserial PRIMARY KEY,
    ts     timestamptz NOT NULL,
    kind   text NOT NULL,
    tenant text NOT NULL DEFAULT '',
    detail jsonb NOT NULL DEFAULT '{}'
);

CREATE INDEX ledger_events_ts ON ledger_events (ts);
CREATE INDEX ledger_events_tenant_ts ON ledger_events (tenant, ts) WHERE tenant <> '';
