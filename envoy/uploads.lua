-- A tenant's uploads counted while their bodies arrive (this filter buffers them, within the
-- route's request_body_buffer_limit), per tenant and in all, per Envoy worker; the tenant is
-- envoy/authn.lua's, before it. Past either bound, the request is refused before its body is
-- read (429 too_many_bodies_in_flight, 503 overloaded). A body whole, or the request answered
-- (a timeout's 408 too), releases the count; a client that resets mid-upload is released when
-- the upload could have lasted no longer (UPLOAD_MS). The body whole, the time is stamped
-- (authzhttp.BODY_AT): extauthz sheds a check that then waited too long.

local BODY_AT = "{{ authzhttp.BODY_AT }}"
local TENANT_BYTES = {{ settings.uploads.tenant_bytes }}
local TOTAL_BYTES = {{ settings.uploads.total_bytes }}
local MAX_BODY = {{ settings.max_request_bytes }}
local UPLOAD_MS = {{ settings.uploads.upload_ms }}
local AUTHN = "llmgw.authn"
local NAMESPACE = "llmgw.uploads"

local function refusal(status, kind, code, message)
  return {[":status"] = status, ["content-type"] = "application/json", ["retry-after"] = "1",
    ["retry-after-ms"] = "1000"}, '{"error": {"message": "' .. message .. '", "type": "'
    .. kind .. '", "param": null, "code": "' .. code .. '"}}'
end

local TENANT_FULL_HEADERS, TENANT_FULL = refusal("429", "rate_limit_error",
  "too_many_bodies_in_flight", "Too many request bodies of this tenant are being uploaded; "
  .. "retry when some are done.")
local ALL_FULL_HEADERS, ALL_FULL = refusal("503", "server_error", "overloaded",
  "The gateway is receiving too many request bodies; please retry.")

-- Per worker (each Envoy worker thread has its own Lua state).
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

local function respond(handle, headers, body)
  -- Marked, so that the local-reply mappers keep this OpenAI error as it is.
  handle:streamInfo():dynamicMetadata():set(AUTHN, "answered", true)
  handle:respond(headers, body)
end

function envoy_on_request(handle)
  local headers = handle:headers()
  local method = headers:get(":method")
  local authn = handle:streamInfo():dynamicMetadata():get(AUTHN)
  if method == "GET" or method == "HEAD" or authn == nil then
    return
  end
  local tenant = authn["tenant"]
  local now = handle:timestamp()
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
  -- A call that waits (body) ends the header map's scope: it is asked for anew.
  handle:headers():replace(BODY_AT, tostring(handle:timestamp()))
end

function envoy_on_response(handle)
  -- Answered before the body was whole (a timeout's 408, a refusal): its count goes now.
  local meta = handle:streamInfo():dynamicMetadata():get(NAMESPACE)
  if meta ~= nil and meta["upload"] ~= nil then
    release(meta["upload"])
  end
end
