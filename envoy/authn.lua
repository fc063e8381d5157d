-- A request without an API key of ours is refused at its headers, before Envoy buffers its body
-- for ext_authz: nobody without a key can make the gateway hold large buffers open. Whose key it
-- is, and whether it is valid, extauthz decides (the same messages as extauthz/decision.py).

local PREFIX = "{{ wire.KEY_PREFIX }}"

local function refusal(message)
  return '{"error": {"message": "' .. message .. '", "type": "invalid_request_error", '
    .. '"param": null, "code": "invalid_api_key"}}'
end

local MISSING = refusal("You didn't provide an API key. Send it as 'Authorization: Bearer KEY' "
  .. "or 'api-key: KEY'.")
local INCORRECT = refusal("Incorrect API key provided.")

function envoy_on_request(handle)
  local headers = handle:headers()
  if (headers:get(":path") or ""):sub(1, 4) ~= "/v1/" then
    return -- not an API route: Envoy's own 404
  end
  local auth, key = headers:get("authorization"), headers:get("api-key")
  local token
  if auth ~= nil then
    token = auth:match("^%s*[Bb][Ee][Aa][Rr][Ee][Rr]%s+(%S+)%s*$")
  elseif key ~= nil then
    token = key:match("^%s*(%S+)%s*$")
  else
    handle:respond({[":status"] = "401", ["content-type"] = "application/json"}, MISSING)
    return
  end
  if token == nil or token:sub(1, #PREFIX) ~= PREFIX then
    handle:respond({[":status"] = "401", ["content-type"] = "application/json"}, INCORRECT)
  end
end
