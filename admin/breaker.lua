-- One tenant's breaker as it stands, for the admin API (admin/breakers.py), the rule prepended
-- (llmgw/breaker.lua): cb_state at Redis's time, changing nothing. KEYS[1]: the breaker's key.
-- Returns Redis's time (ms), then cb_state's answer.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local state = cb_state(KEYS[1], now)
table.insert(state, 1, cb_int(now))
return state
