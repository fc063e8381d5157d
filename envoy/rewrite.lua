-- What the pod receives, and what the client is shown, is what the gateway decided.
--
-- Requests: extauthz names JSON members of its own (`"cache_salt": "…", "max_tokens": N`) in
-- {{ wire.EXTAUTHZ_NAMESPACE }}/{{ wire.META_BODY_SUFFIX }}, and this filter appends
-- them to the request's JSON object, after whatever the client sent. The pod's parser, like
-- extauthz's, keeps the last of duplicate keys, so the gateway's value is the one it uses: the
-- output cap the pod respects is the one the token reservation holds.
-- extauthz has checked that the body is one JSON object; only the trailing "}" is touched.
--
-- A tenant's hard budget with less left than the request's estimate lowers the cap: the rate
-- limiter says so in {{ services.admission_namespace }}/{{ wire.META_OUTPUT_CAP }} (this filter
-- runs after it), and that cap follows extauthz's members, so it is the last and the one the pod
-- uses.

local FACTS = "{{ wire.EXTAUTHZ_NAMESPACE }}"
local SUFFIX = "{{ wire.META_BODY_SUFFIX }}"
local ADMISSION = "{{ services.admission_namespace }}"
local OUTPUT_CAP = "{{ wire.META_OUTPUT_CAP }}"
local CLOSE = string.byte("}")
local ALLOWED = "{{ wire.META_ALLOWED_MODELS }}"

-- The budget's cap for the members extauthz capped (chat also names max_completion_tokens;
-- the Responses API has max_output_tokens).
local CAPS = {"max_tokens", "max_completion_tokens", "max_output_tokens"}

local function lowered(suffix, cap)
  local value = string.format("%d", cap)
  local out = suffix
  for _, name in ipairs(CAPS) do
    if suffix:find('"' .. name .. '"', 1, true) then
      out = out .. ',"' .. name .. '":' .. value
    end
  end
  return out
end

function envoy_on_request(handle)
  local metadata = handle:streamInfo():dynamicMetadata()
  local facts = metadata:get(FACTS)
  local suffix = facts and facts[SUFFIX]
  if suffix == nil then
    return
  end
  local admission = metadata:get(ADMISSION)
  local cap = admission and admission[OUTPUT_CAP]
  if cap ~= nil then
    cap = tonumber(cap) -- a string when extauthz answers over HTTP
  end
  if cap ~= nil then
    suffix = lowered(suffix, cap)
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

-- Responses: a tenant with an allow-list sees only those of the pods' models (GET /v1/models,
-- vLLM's `{"object": "list", "data": [{"id": …, …}, …]}`).
function envoy_on_response(handle)
  local facts = handle:streamInfo():dynamicMetadata():get(FACTS)
  local allowed = facts and facts[ALLOWED]
  if allowed == nil or handle:headers():get(":status") ~= "200" then
    return
  end
  local keep = {}
  for name in allowed:gmatch("%S+") do
    keep[name] = true
  end
  local body = handle:body()
  local text = body:getBytes(0, body:length())
  local key = text:find('"data"%s*:%s*%[')
  local open = key and text:find("[", key, true)
  local first, last = nil, nil
  if open then
    first, last = text:find("%b[]", open)
  end
  local shown = '{"object":"list","data":[]}'  -- not a list we can read: show nothing
  if first ~= nil then
    local kept = {}
    for model in text:sub(first + 1, last - 1):gmatch("%b{}") do
      local id = model:match('"id"%s*:%s*"([^"]*)"')  -- a card's first member is its id
      if id ~= nil and keep[id] then
        kept[#kept + 1] = model
      end
    end
    shown = text:sub(1, first) .. table.concat(kept, ",") .. text:sub(last)
  end
  body:setBytes(shown)
  handle:headers():replace("content-length", tostring(#shown))
end
