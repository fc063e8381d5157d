-- Settle one request's tokens at stream end, atomically.
-- KEYS[1]: the tenant's key prefix. ARGV: now_ms, reservation id, actual tokens, check count,
--          then per check (the tenant's token checks): name, bucket_ms, buckets.
-- With a live reservation: add (actual - reserved) to the buckets the reservation took, if they
-- still exist. Without one (expired, never made): add the actual tokens to the current buckets.
-- Returns {1 if a reservation was settled else 0, tokens added (may be negative)}.
local p = KEYS[1]
local now = tonumber(ARGV[1])
local rid = ARGV[2]
local actual = tonumber(ARGV[3])
local n = tonumber(ARGV[4])
local rkey = p .. ':res:' .. rid
local r = redis.call('HMGET', rkey, 'n', 'k')
if rid ~= '' and r[1] then
  local delta = actual - tonumber(r[1])
  if delta ~= 0 then
    for suffix in string.gmatch(r[2], '%S+') do
      local k = p .. ':' .. suffix
      if redis.call('EXISTS', k) == 1 then redis.call('INCRBY', k, delta) end
    end
  end
  redis.call('DEL', rkey)
  redis.call('ZREM', p .. ':resv', rid)
  return {1, delta}
end
if actual > 0 then
  local a = 5
  for i = 1, n do
    local name, bms, nb = ARGV[a], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
    a = a + 3
    local key = p .. ':' .. name .. ':' .. string.format('%d', math.floor(now / bms))
    redis.call('INCRBY', key, actual)
    redis.call('PEXPIRE', key, (nb + 1) * bms)
  end
end
return {0, actual}
