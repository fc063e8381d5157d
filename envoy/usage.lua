-- Usage is known for every stream: the pods end each stream with a usage chunk (vLLM
-- --enable-force-include-usage; the simulator's --force-include-usage), sse_to_metadata reads it
-- on its way out, and this filter then drops it for clients that did not ask for it
-- (stream_options.include_usage), so they see exactly what OpenAI would send them.
-- Only streams of such clients are touched; events are passed on as soon as they are complete.

function envoy_on_request(handle)
  local body = handle:body()
  if body == nil then
    return
  end
  local text = body:getBytes(0, body:length())
  if text:find('"stream"%s*:%s*true') and not text:find('"include_usage"%s*:%s*true') then
    handle:streamInfo():dynamicMetadata():set("{{ wire.USAGE_NAMESPACE }}", "strip", "1")
  end
end

local function usage_only(event)
  return event:find('"choices"%s*:%s*%[%s*%]') and event:find('"usage"%s*:%s*{')
end

function envoy_on_response(handle)
  local meta = handle:streamInfo():dynamicMetadata():get("{{ wire.USAGE_NAMESPACE }}")
  if meta == nil or meta["strip"] == nil then
    return
  end
  local held = ""
  for chunk in handle:bodyChunks() do
    local text = held .. chunk:getBytes(0, chunk:length())
    local out, at = {}, 1
    while true do
      local _, stop = text:find("\n\n", at, true)
      if stop == nil then
        break
      end
      local event = text:sub(at, stop)
      if not usage_only(event) then
        out[#out + 1] = event
      end
      at = stop + 1
    end
    held = text:sub(at)
    chunk:setBytes(table.concat(out))
  end
end
