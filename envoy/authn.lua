-- Who is calling, asked at the request's headers, before Envoy buffers any of its body: a
-- stranger is refused at once. extauthz reads the key (authzhttp.KEY_PATH: the one reading of a
-- key from the headers, extauthz/decision.py key_entry); its answer is cached per worker for
-- KEY_TTL_MS, so a tenant's requests cost no call. The full check (ext_authz, with the body)
-- verifies the key again, so revocation stays extauthz's: the cache only decides who may make
-- Envoy buffer, for at most KEY_TTL_MS after a revocation. The tenant goes to envoy/uploads.lua
-- in this filter's metadata. While extauthz is asked (a cache miss: ~1 ms), what body arrives
-- waits in this filter, within the route's request_body_buffer_limit; refused, it is dropped.

local KEY_PATH = "{{ authzhttp.KEY_PATH }}"
local TENANT_HEADER = "{{ wire.HEADER_TENANT }}"
local CLUSTER = "extauthz_keys"
local ASKED_AT = "{{ authzhttp.BODY_AT }}"
local STATUS = "{{ wire.META_STATUS }}"
local KEY_TIMEOUT_MS = {{ settings.uploads.key_timeout_ms }}
local KEY_TTL_MS = {{ settings.uploads.key_cache_ms }}
local KEY_CACHE_MAX = {{ settings.uploads.key_cache_entries }}
local NAMESPACE = "llmgw.authn"

local function refusal(status, kind, code, message, retry)
  local headers = {[":status"] = status, ["content-type"] = "application/json"}
  if retry then
    headers["retry-after"] = "1"
    headers["retry-after-ms"] = "1000"
  end
  return headers, '{"error": {"message": "' .. message .. '", "type": "' .. kind
    .. '", "param": null, "code": "' .. code .. '"}}'
end

local MISSING_HEADERS, MISSING = refusal("401", "invalid_request_error", "invalid_api_key",
  "You didn't provide an API key. Send it as 'Authorization: Bearer KEY' or 'api-key: KEY'.")
local DOWN_HEADERS, DOWN = refusal("503", "server_error", "authorization_unavailable",
  "The authorization service is unavailable; please retry.", true)
local BUSY_HEADERS, BUSY = refusal("503", "server_error", "overloaded",
  "The gateway is overloaded. Please retry shortly.", true)

-- Per worker (each Envoy worker thread has its own Lua state).
keys = keys or {}        -- credential headers -> {tenant, expires_ms}
key_count = key_count or 0

local function tenant_of(handle, headers, now)
  local auth, api_key = headers:get("authorization"), headers:get("api-key")
  if auth == nil and api_key == nil then
    return nil, MISSING_HEADERS, MISSING
  end
  local credential = (auth or "") .. "\n" .. (api_key or "")
  local cached = keys[credential]
  if cached ~= nil and cached[2] > now then
    return cached[1]
  end
  -- Stamped: extauthz sheds a question that waited too long (503 overloaded) rather than let
  -- it time out here.
  local ask = {[":method"] = "GET", [":path"] = KEY_PATH, [":authority"] = "extauthz",
    [ASKED_AT] = tostring(now)}
  if auth ~= nil then
    ask["authorization"] = auth
  end
  if api_key ~= nil then
    ask["api-key"] = api_key
  end
  local answer, body = handle:httpCall(CLUSTER, ask, "", KEY_TIMEOUT_MS)
  local status = answer[":status"]
  if status == "200" and answer[TENANT_HEADER] ~= nil then
    if key_count >= KEY_CACHE_MAX then
      keys, key_count = {}, 0
    end
    if cached == nil then
      key_count = key_count + 1
    end
    keys[credential] = {answer[TENANT_HEADER], now + KEY_TTL_MS}
    return answer[TENANT_HEADER]
  end
  if answer["content-type"] == "application/json" then
    -- extauthz's own refusal (a bad key's 401, an overloaded 503 sent with its status beside
    -- it: authzhttp.py), passed on as it is.
    local refused = {[":status"] = answer[STATUS] or status, ["content-type"] = "application/json"}
    refused["retry-after"] = answer["retry-after"]
    return nil, refused, body
  end
  if status == "504" then  -- no answer in time: extauthz is swamped
    return nil, BUSY_HEADERS, BUSY
  end
  return nil, DOWN_HEADERS, DOWN
end

local function respond(handle, headers, body)
  -- Marked, so that the local-reply mappers keep this OpenAI error as it is.
  handle:streamInfo():dynamicMetadata():set(NAMESPACE, "answered", true)
  handle:respond(headers, body)
end

function envoy_on_request(handle)
  local tenant, refused, message = tenant_of(handle, handle:headers(), handle:timestamp())
  if tenant == nil then
    respond(handle, refused, message)
    return
  end
  handle:streamInfo():dynamicMetadata():set(NAMESPACE, "tenant", tenant)
end
