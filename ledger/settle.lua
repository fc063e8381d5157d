-- Settle one request's tokens, atomically and at most once (idempotent by request ID).
-- KEYS[1]: the tenant's key prefix (llmgw.wire.tenant_prefix). ARGV: now_ms, request id, actual
-- tokens, done_ttl_ms.
-- The reservation `<prefix>:res:<id>` (ratelimit/admit.lua) holds n = tokens reserved and s = one
-- "name bucket_ms buckets bucket_index" quadruple per token window it was charged to. Per window:
--   * reserved bucket still inside the window: refund (n - actual) into it, or add the excess
--     (actual - n) to the current bucket;
--   * reserved bucket already left the window (a stream longer than it): charge the actual tokens
--     to the current bucket, so the stream counts in every window it ran in.
-- Without a reservation (admitted fail-open or degraded, or expired) the actual tokens are charged
-- to the current buckets of the tenant's windows (`<prefix>:tspec`), when known.
-- Returns {1 reservation settled | 0 none | 2 already settled, tokens reserved, tokens charged}.
local p = KEYS[1]
local now = tonumber(ARGV[1])
local rid = ARGV[2]
local actual = tonumber(ARGV[3])
local done = p .. ':done:' .. rid
if redis.call('EXISTS', done) == 1 then return {2, 0, 0} end
local rkey = p .. ':res:' .. rid
local r = redis.call('HMGET', rkey, 'n', 's')
local found = r[1] and 1 or 0
local reserved = tonumber(r[1]) or 0
local spec = r[2]
if found == 0 then spec = redis.call('GET', p .. ':tspec') end
if spec and (found == 1 or actual > 0) then
  local f = {}
  for w in string.gmatch(spec, '%S+') do f[#f + 1] = w end
  for i = 1, #f - 3, 4 do
    local name, bms, nb, idx = f[i], tonumber(f[i + 1]), tonumber(f[i + 2]), tonumber(f[i + 3])
    local cur = math.floor(now / bms)
    local ckey = p .. ':' .. name .. ':' .. string.format('%d', cur)
    local add = actual
    if found == 1 and idx > cur - nb then
      add = actual - reserved
      if add < 0 then
        local rk = p .. ':' .. name .. ':' .. string.format('%d', idx)
        if redis.call('EXISTS', rk) == 1 then redis.call('DECRBY', rk, -add) end
      end
    end
    if add > 0 then
      redis.call('INCRBY', ckey, add)
      redis.call('PEXPIRE', ckey, (nb + 1) * bms)
    end
  end
end
if found == 1 then redis.call('DEL', rkey) end
redis.call('SET', done, 1, 'PX', tonumber(ARGV[4]))
return {found, reserved, spec and actual or 0}
