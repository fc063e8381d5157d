-- One admission decision, atomically (rule: ratelimit/windows.py).
-- KEYS[1]: the tenant's key prefix "llmgw:rl:{tenant}"; every key below shares its hash tag.
-- ARGV: now_ms, shadow (0/1), reservation id ("" for none), reservation ttl_ms, check count,
--       then per check: name, bucket_ms, buckets, limit, cost, reserve (0/1).
-- Returns one string of integers separated by spaces: admitted (0/1), then each check's buckets
-- before this decision, newest first. One bulk string, not an array of integers: the client
-- reads one reply instead of one per bucket (about 25 per decision).
local p = KEYS[1]
local now = tonumber(ARGV[1])
local shadow = ARGV[2] == '1'
local rid = ARGV[3]
local ttl = tonumber(ARGV[4])
local n = tonumber(ARGV[5])

local out = {'0'}
local plan = {}
local ok = true
local longest = 0
local a = 6
for i = 1, n do
  local name, bms, nb = ARGV[a], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local limit, cost, reserve = tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4]), ARGV[a + 5] == '1'
  a = a + 6
  local cur = math.floor(now / bms)
  local keys = {}
  for j = 0, nb - 1 do keys[j + 1] = p .. ':' .. name .. ':' .. string.format('%d', cur - j) end
  local vals = redis.call('MGET', unpack(keys))
  local used = 0
  for j = 1, nb do
    local v = tonumber(vals[j]) or 0
    used = used + v
    out[#out + 1] = string.format('%d', v)
  end
  if used + cost > limit then ok = false end
  if nb * bms > longest then longest = nb * bms end
  plan[i] = {keys[1], name .. ' ' .. bms .. ' ' .. nb .. ' ' .. string.format('%d', cur), cost, (nb + 1) * bms, reserve}
end

if ok or shadow then
  local taken = {}
  local amount = 0
  for i = 1, n do
    local key, suffix, cost, life, reserve = unpack(plan[i])
    if cost > 0 then
      redis.call('INCRBY', key, cost)
      redis.call('PEXPIRE', key, life)
      if reserve then
        taken[#taken + 1] = suffix
        amount = cost
      end
    end
  end
  if #taken > 0 then
    local spec = table.concat(taken, ' ')
    -- The reservation, for the ledger's settlement (ledger/settle.lua). Never given back by
    -- itself: one that is never settled stays charged as reserved.
    if rid ~= '' then
      local rkey = p .. ':res:' .. rid
      redis.call('HSET', rkey, 'n', amount, 's', spec)
      redis.call('PEXPIRE', rkey, ttl)
    end
    -- The tenant's token windows, for settling usage that had no reservation (admitted while
    -- this service was down or degraded, or settled after its reservation expired).
    redis.call('SET', p .. ':tspec', spec, 'PX', longest + ttl)
  end
end
if ok then out[1] = '1' end
return table.concat(out, ' ')
