-- Flow control's service counts (extauthz/fairness.py), shared by the replicas: each replica's
-- batch of what it dispatched since its last one, merged at Redis's clock, and every tenant's
-- merged count back. A count halves every half-life; one below a token is dropped.
-- KEYS[1]: the hash (tenant -> "count:at_ms"). ARGV: half-life ms, TTL ms, then per tenant of the
-- batch: tenant, tokens, floor (the count it was lifted to: at least this before the tokens).
local key = KEYS[1]
local half_life, ttl = tonumber(ARGV[1]), tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rate = math.log(2) / half_life

local function decayed(stored)
  if not stored then
    return 0
  end
  local count, at = string.match(stored, '^([^:]+):(%d+)$')
  if not count then
    return 0
  end
  return tonumber(count) * math.exp(-rate * math.max(0, now - tonumber(at)))
end

for i = 3, #ARGV, 3 do
  local tenant = ARGV[i]
  local count = math.max(decayed(redis.call('HGET', key, tenant)), tonumber(ARGV[i + 2]))
  count = count + tonumber(ARGV[i + 1])
  redis.call('HSET', key, tenant, string.format('%.6f:%d', count, now))
end
local out = {}
local all = redis.call('HGETALL', key)
for i = 1, #all, 2 do
  local count = decayed(all[i + 1])
  if count < 1 then
    redis.call('HDEL', key, all[i])
  else
    out[#out + 1] = all[i]
    out[#out + 1] = string.format('%.6f', count)
  end
end
redis.call('PEXPIRE', key, ttl)
return out
