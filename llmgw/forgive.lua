-- Forgive what a tenant's money budget has settled in its current window (`llmgw spend reset`),
-- atomically, at Redis's own time: the window then holds only the reservations outstanding,
-- which settle as before (llmgw/settle.lua), and its soft limits alert again.
-- KEYS[1]: the tenant's key prefix (llmgw.wire.tenant_prefix); the keys are
-- llmgw/reservation.lua's, prepended to this script. ARGV: the window's check name
-- ("spend:day", "spend:month"), its bucket_ms (0: a calendar month), its period ("day", "month").
-- Returns {bucket index, micro-units forgiven, micro-units still held}.
local p = KEYS[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local name, bms, period = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local idx = rs_index(now, bms)
local skey = rs_settled(p, name, idx)
local bkey = rs_bucket(p, name, idx)
local settled = tonumber(redis.call('GET', skey)) or 0
local held = tonumber(redis.call('GET', bkey)) or 0
local forgiven = math.min(settled, held)
if forgiven > 0 then redis.call('DECRBY', bkey, string.format('%d', forgiven)) end
redis.call('DEL', skey)
-- ledger/spending.py's claims of this window's alerts, one a percentage.
local claim = p .. ':spendalert:' .. period .. ':' .. string.format('%d', idx) .. ':'
for pct = 1, 100 do redis.call('DEL', claim .. pct) end
return {idx, forgiven, held - forgiven}
