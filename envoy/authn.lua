-- Who is calling, asked at the request's headers, before Envoy reads any of its body: a stranger
-- is refused at once and holds no buffer. extauthz reads the key (authzhttp.KEY_PATH: the one
-- reading of a key from the headers, extauthz/decision.py key_entry); its answer is cached per
-- worker for KEY_TTL_MS, so a tenant's requests cost no call. The full check (ext_authz, with
-- the body) verifies the key again, so revocation stays extauthz's: the cache only decides who
-- may make Envoy buffer, for at most KEY_TTL_MS after a revocation.
--
-- Then the tenant's upload is counted while its body arrives (this filter buffers it, within the
-- route's request_body_buffer_limit): per tenant and in all, per Envoy worker. Past either, the
-- request is refused before any byte is read (429 too_many_bodies_in_flight, 503 overloaded).
-- A body done, or the request answered (a timeout's 408 too), releases the count; a client that
-- resets mid-upload is released when the upload could have lasted no longer (UPLOAD_MS).

local KEY_PATH = "{{ authzhttp.KEY_PATH }}"
local TENANT_HEADER = "{{ wire.HEADER_TENANT }}"
local BODY_AT = "{{ authzhttp.BODY_AT }}"
local CLUSTER = "{{ services.key_cluster }}"
local KEY_TTL_MS = {{ settings.uploads.key_cache_ms }}
local KEY_CACHE_MAX = {{ settings.uploads.key_cache_entries }}
local TENANT_BYTES = {{ settings.uploads.tenant_bytes }}
local TOTAL_BYTES = {{ settings.uploads.total_bytes }}
local MAX_BODY = {{ settings.max_request_bytes }}
local UPLOAD_MS = {{ settings.uploads.upload_ms }}
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
local TENANT_FULL_HEADERS, TENANT_FULL = refusal("429", "rate_limit_error",
  "too_many_bodies_in_flight", "Too many request bodies of this tenant are being uploaded; "
  .. "retry when some are done.", true)
local ALL_FULL_HEADERS, ALL_FULL = refusal("503", "server_error", "overloaded",
  "The gateway is receiving too many request bodies; please retry.", true)

-- Per worker (each Envoy worker thread has its own Lua state).
keys = keys or {}        -- credential headers -> {tenant, expires_ms}
key_count = key_count or 0
held = held or {}        -- tenant -> bytes being uploaded
held_total = held_total or 0
uploads = uploads or {}  -- request ID -> {tenant, bytes, expires_ms}
next_sweep = next_sweep or 0

local function release(id)
  local upload = uploads[id]
  if upload == nil then
    return
  end
  uploads[id] = nil
  held[upload[1]] = held[upload[1]] - upload[2]
  if held[upload[1]] <= 0 then
    held[upload[1]] = nil
  end
  held_total = held_total - upload[2]
end

local function sweep(now)
  -- Uploads whose client reset the stream: no callback comes, their time bounds them.
  if now < next_sweep then
    return
  end
  next_sweep = now + 1000
  for id, upload in pairs(uploads) do
    if upload[3] < now then
      release(id)
    end
  end
end

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
  local ask = {[":method"] = "GET", [":path"] = KEY_PATH, [":authority"] = "extauthz"}
  if auth ~= nil then
    ask["authorization"] = auth
  end
  if api_key ~= nil then
    ask["api-key"] = api_key
  end
  local answer, body = handle:httpCall(CLUSTER, ask, "", 1000)
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
  if status == "401" then
    return nil, {[":status"] = "401", ["content-type"] = "application/json"}, body
  end
  return nil, DOWN_HEADERS, DOWN
end

local function respond(handle, headers, body)
  -- Marked, so that the local-reply mappers keep this OpenAI error as it is.
  handle:streamInfo():dynamicMetadata():set(NAMESPACE, "answered", true)
  handle:respond(headers, body)
end

function envoy_on_request(handle)
  local headers = handle:headers()
  local now = handle:timestamp()
  local tenant, refused, message = tenant_of(handle, headers, now)
  if tenant == nil then
    respond(handle, refused, message)
    return
  end
  local method = headers:get(":method")
  if method == "GET" or method == "HEAD" then
    return
  end
  sweep(now)
  local declared = tonumber(headers:get("content-length") or "")
  local size = declared ~= nil and math.min(declared, MAX_BODY) or MAX_BODY
  if held_total + size > TOTAL_BYTES then
    respond(handle, ALL_FULL_HEADERS, ALL_FULL)
    return
  end
  if (held[tenant] or 0) + size > TENANT_BYTES then
    respond(handle, TENANT_FULL_HEADERS, TENANT_FULL)
    return
  end
  local id = headers:get("x-request-id")
  held[tenant] = (held[tenant] or 0) + size
  held_total = held_total + size
  uploads[id] = {tenant, size, now + UPLOAD_MS}
  handle:streamInfo():dynamicMetadata():set(NAMESPACE, "upload", id)
  handle:body()
  release(id)
  headers:replace(BODY_AT, tostring(handle:timestamp()))
end

function envoy_on_response(handle)
  -- Answered before the body was whole (a timeout's 408, a refusal): its count goes now.
  local meta = handle:streamInfo():dynamicMetadata():get(NAMESPACE)
  if meta ~= nil and meta["upload"] ~= nil then
    release(meta["upload"])
  end
end
