-- The admin API's tables (admin/): the tenants and their keys, the source of truth when the
-- admin API is in use (every extauthz replica follows them), and the audit of every change.
-- A tenant's `rev` takes the sequence's next value at every change to it or to one of its keys,
-- so a reader follows the changes by revision: `WHERE rev > $last` (deleted tenants stay as
-- tombstones, `deleted` true, so that a reader learns they went).
CREATE SEQUENCE tenant_revisions;

CREATE TABLE tenants (
    id      text PRIMARY KEY,
    -- extauthz/types.py Tenant as JSON, without its keys (they are rows of api_keys)
    spec    jsonb NOT NULL,
    rev     bigint NOT NULL DEFAULT nextval('tenant_revisions'),
    deleted boolean NOT NULL DEFAULT false,
    updated timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX tenants_rev ON tenants (rev);

CREATE TABLE api_keys (
    id      text PRIMARY KEY,                       -- ApiKey.id, key_…
    tenant  text NOT NULL REFERENCES tenants (id),
    sha256  text NOT NULL UNIQUE,                   -- hex SHA-256 of the key; never the key
    prefix  text NOT NULL,
    created timestamptz NOT NULL,
    expires timestamptz,
    revoked boolean NOT NULL DEFAULT false
);
CREATE INDEX api_keys_tenant ON api_keys (tenant);

CREATE TABLE audit (
    id     bigserial PRIMARY KEY,
    at     timestamptz NOT NULL DEFAULT now(),
    actor  text NOT NULL,          -- who: "admin-token" (or an OIDC subject)
    action text NOT NULL,          -- e.g. tenant.create, key.create, key.revoke, key.rotate
    target text NOT NULL,          -- the tenant or key ID
    detail jsonb NOT NULL DEFAULT '{}'  -- never a key
);
CREATE INDEX audit_at ON audit (at);

-- Every change commits with: UPDATE tenants SET rev = nextval('tenant_revisions'), updated = now()
-- WHERE id = $tenant; then SELECT pg_notify('llmgw_tenants', <that rev as text>) in the same
-- transaction (delivered at commit).
