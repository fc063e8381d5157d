-- What a stream really delivered, and only the usage the client asked for.
--
-- Decided from extauthz's request facts (stream, include_usage), never from the raw body. For
-- every SSE response it counts the content events (those with a choice; the Responses API's
-- deltas of text, reasoning and tool calls, whose usage always ends the stream) that reach the
-- client
-- into {{ wire.USAGE_NAMESPACE }}/{{ wire.META_STREAMED_EVENTS }}, so the access log of a stream cut
-- short (client hung up, pod reset) still says how many tokens were streamed. Pods send usage for
-- every stream (vLLM --enable-force-include-usage: a final usage-only event, or since vLLM 0.20
-- usage on every event); sse_to_metadata has read it before this filter, which then removes it
-- for clients that did not ask for it, so they see exactly what OpenAI would send them. An error
-- event (the pod failed mid-stream; the Responses API's `error` or `response.failed`) is marked
-- in {{ wire.META_STREAM_FAILED }}.

local FACTS = "{{ wire.EXTAUTHZ_NAMESPACE }}"
local USAGE = "{{ wire.USAGE_NAMESPACE }}"
local STREAMED = "{{ wire.META_STREAMED_EVENTS }}"
local FAILED = "{{ wire.META_STREAM_FAILED }}"

-- A fact extauthz answered over HTTP is a string (llmgw/authzhttp.py).
local function flag(value)
  return value == true or value == "true"
end

local function has_choice(event)
  return event:find('"choices"%s*:%s*%[%s*{') ~= nil
end

-- The Responses API names each event on its own line first (vLLM writes `event: TYPE`), which no
-- JSON string can fake: a string's newlines are escaped. nil: a chat or completions event.
local function kind_of(event)
  return event:match("^event: ([%w_%.]+)\n")
end

-- A choice's first event names the role and carries no token.
local function role_only(event)
  return event:find('"role"%s*:%s*"assistant"') ~= nil and event:find('"content"%s*:%s*""') ~= nil
end

-- `,"usage":{...}` is structural JSON: inside a string value every quote is escaped.
local function without_usage(event)
  return (event:gsub(',%s*"usage"%s*:%s*%b{}', '', 1))
end

function envoy_on_response(handle)
  local facts = handle:streamInfo():dynamicMetadata():get(FACTS)
  if facts == nil or not flag(facts["{{ wire.META_STREAM }}"]) then
    return
  end
  local ctype = handle:headers():get("content-type") or ""
  if ctype:find("text/event-stream", 1, true) == nil then
    return
  end
  local strip = not flag(facts["{{ wire.META_INCLUDE_USAGE }}"])
  local streamed, held = 0, ""
  for chunk in handle:bodyChunks() do
    local size = chunk:length()
    local text = held .. chunk:getBytes(0, size)
    local out, at = {}, 1
    while true do
      local _, stop = text:find("\n\n", at, true)
      if stop == nil then
        break
      end
      local event = text:sub(at, stop)
      local kind = kind_of(event)
      if kind ~= nil then
        -- Each step's output: text, reasoning, a tool call's arguments (`response.*.delta`).
        if kind:sub(1, 9) == "response." and kind:sub(-6) == ".delta" then
          streamed = streamed + 1
        elseif kind == "error" or kind == "response.failed" then
          handle:streamInfo():dynamicMetadata():set(USAGE, FAILED, true)
        end
        out[#out + 1] = event
      elseif has_choice(event) then
        if not role_only(event) then
          streamed = streamed + 1
        end
        out[#out + 1] = strip and without_usage(event) or event
      else
        if event:find('^data:%s*[{]%s*"error"%s*:') then
          -- The pod failed after its 200 (vLLM sends the error as an event): the outcome says so.
          handle:streamInfo():dynamicMetadata():set(USAGE, FAILED, true)
        end
        if not (strip and event:find('"usage"%s*:%s*{')) then
          out[#out + 1] = event
        end
      end
      at = stop + 1
    end
    held = text:sub(at)
    -- The stream's end: an HTTP/1.1 chunked response (vLLM's) ends with an empty chunk, and
    -- nothing more will complete a held partial event, so it goes out as the pod sent it. (A
    -- response whose last data frame also ends it would keep the tail: Lua sees no end flag.)
    if size == 0 and held ~= "" then
      out[#out + 1] = held
      held = ""
    end
    -- Unchanged bytes pass as they came; only a stream that loses usage events is rewritten
    -- (then a trailing partial event waits for the rest of it).
    if strip then
      chunk:setBytes(table.concat(out))
    end
    -- Fetched again each time: Envoy's objects do not outlive the yield to the next chunk.
    handle:streamInfo():dynamicMetadata():set(USAGE, STREAMED, streamed)
  end
end
