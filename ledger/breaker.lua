-- One tenant's outcomes of a batch into its breaker (ledger/breaker.py), the rule prepended
-- (llmgw/breaker.lua). KEYS[1]: the breaker's key; ARGV: cb_feed's. Returns Redis's time (ms)
-- and the transitions.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local events = cb_feed(KEYS[1], now, ARGV)
table.insert(events, 1, cb_int(now))
return events
