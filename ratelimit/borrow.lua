-- Draw from, or give back to, the fleet's borrowing pool, atomically (rule: ratelimit/pool.py).
-- KEYS[1]: the pool's key prefix "llmgw:pool:{fleet}"; every key below shares its hash tag.
-- ARGV[1] = 'draw', count, then per window: name, bucket_ms, buckets, cap, amount.
--   At Redis's own time, under the tenants' rolling-window rule (ratelimit/windows.py): draws
--   every amount into the current bucket if, for every window, the pool's use (N buckets plus
--   the one before them, decaying, rounded up) plus the amount stays within cap; else draws
--   nothing. Bucket keys live N + 2 buckets, as admit.lua's.
--   Returns "1 <bucket>..." (the bucket each amount went into) or "0".
-- ARGV[1] = 'back', count, then per window: name, bucket, amount.
--   Takes each amount back out of the bucket it was drawn into, if that bucket still exists.
local p = KEYS[1]
local n = tonumber(ARGV[2])
local a = 3
if ARGV[1] == 'back' then
  for _ = 1, n do
    local key = p .. ':' .. ARGV[a] .. ':' .. ARGV[a + 1]
    if redis.call('EXISTS', key) == 1 then redis.call('DECRBY', key, ARGV[a + 2]) end
    a = a + 3
  end
  return '1'
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local plan = {}
for i = 1, n do
  local name, bms, nb = ARGV[a], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local cap, amount = tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
  a = a + 5
  local cur = math.floor(now / bms)
  local keys = {}
  for j = 0, nb do keys[j + 1] = p .. ':' .. name .. ':' .. string.format('%d', cur - j) end
  local vals = redis.call('MGET', unpack(keys))
  local used = 0
  for j = 1, nb do used = used + (tonumber(vals[j]) or 0) end
  -- ⌈B·w/b⌉ as ⌊B/b⌋·w + ⌈(B mod b)·w/b⌉, exact in Lua's doubles (as in admit.lua).
  local old, w = tonumber(vals[nb + 1]) or 0, bms - (now - cur * bms)
  local q = math.floor(old / bms)
  used = used + q * w + math.floor(((old - q * bms) * w + bms - 1) / bms)
  if used + amount > cap then return '0' end
  plan[i] = {keys[1], amount, (nb + 2) * bms, string.format('%d', cur)}
end
local out = {'1'}
for i = 1, n do
  local key, amount, life, bucket = unpack(plan[i])
  redis.call('INCRBY', key, amount)
  redis.call('PEXPIRE', key, life)
  out[#out + 1] = bucket
end
return table.concat(out, ' ')
