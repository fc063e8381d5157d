-- What the pod receives is what the gateway decided: extauthz names JSON members of its own
-- (`"cache_salt": "…"`) in {{ wire.EXTAUTHZ_NAMESPACE }}/{{ wire.META_BODY_SUFFIX }}, and this filter appends
-- them to the request's JSON object, after whatever the client sent. The pod's parser, like
-- extauthz's, keeps the last of duplicate keys, so the gateway's value is the one it uses.
-- extauthz has checked that the body is one JSON object; only the trailing "}" is touched.

local FACTS = "{{ wire.EXTAUTHZ_NAMESPACE }}"
local SUFFIX = "{{ wire.META_BODY_SUFFIX }}"
local CLOSE = string.byte("}")

function envoy_on_request(handle)
  local facts = handle:streamInfo():dynamicMetadata():get(FACTS)
  local suffix = facts and facts[SUFFIX]
  if suffix == nil then
    return
  end
  local body = handle:body()
  if body == nil then
    return
  end
  local text = body:getBytes(0, body:length())
  for at = #text, 1, -1 do
    if text:byte(at) == CLOSE then
      local rewritten = text:sub(1, at - 1) .. suffix .. text:sub(at)
      body:setBytes(rewritten)
      handle:headers():replace("content-length", tostring(#rewritten))
      return
    end
  end
end
