-- One admission decision, atomically, at Redis's own time (rule: ratelimit/windows.py).
-- KEYS[1]: the tenant's key prefix "llmgw:rl:{tenant}"; its keys are llmgw/reservation.lua's,
-- prepended to this script.
-- ARGV: shadow (0/1), reservation id ("" for none), reservation ttl_ms, check count,
--       then per check: name, bucket_ms (0: a calendar month), buckets, rolling (0/1), limit,
--       cost, reserve (0: no, 1: part of the token reservation, 2: that and a hard budget that
--       may lower the cap, 3: a money budget, in micro-units, that may lower the cap),
--       then the grant: the reservation's prompt and sequences (cost = prompt + cap × sequences;
--       sequences 0: no grant), and its money parts base and per_cap (a money check's cost =
--       base + ⌈cap × per_cap / 10^6⌉; per_cap 0: a money budget does not lower the cap).
-- The grant: when a hard budget has less left than the cost but at least prompt + sequences, the
-- request is admitted at cap = ⌊(left − prompt) / sequences⌋ (a money budget's: ⌊(left − base) ×
-- 10^6 / per_cap⌋; the least over such budgets), and every reserving check costs
-- prompt + cap × sequences instead, every money check base + ⌈cap × per_cap / 10^6⌉
-- (ratelimit/types.py Grant).
-- Returns one string of integers separated by spaces: admitted (0/1), the time it decided at
-- (ms), then each check's buckets before this decision, newest first (buckets + rolling of them),
-- then the cap it granted (0: the request's own stands).
-- One bulk string, not an array of integers: the client reads one reply instead of one per bucket.
-- KEYS[2], when given: the tenant's breaker (llmgw/breaker.lua, prepended to this script). Open,
-- or half-open and not this request's turn, it refuses first, reading and charging no window,
-- and the reply is "2 <time> <wait ms>".
-- ⌊x · 10^6 / d⌋ for integers 0 ≤ x < 2^50 and 0 < d < 2^43, exact in doubles: a long division
-- in base 1000 (a product x · 10^6 would not be). Exact while the quotient is below 2^53.
local function muldiv(x, d)
  local q = math.floor(x / d)
  local r = x - q * d
  if r < 0 then q, r = q - 1, r + d elseif r >= d then q, r = q + 1, r - d end
  for _ = 1, 2 do
    local y = r * 1000
    local k = math.floor(y / d)
    r = y - k * d
    if r < 0 then k, r = k - 1, r + d elseif r >= d then k, r = k + 1, r - d end
    q = q * 1000 + k
  end
  return q
end

-- A money check's cost at cap c ≤ muldiv(left − base, per_cap): base + ⌈c · per_cap / 10^6⌉,
-- split so that each product stays below 2^53.
local function money_cost(c, base, per_cap)
  local ph = math.floor(per_cap / 1000000)
  local pl = per_cap - ph * 1000000
  local c1 = math.floor(c / 1000000)
  local c0 = c - c1 * 1000000
  return base + c * ph + c1 * pl + math.floor((c0 * pl + 999999) / 1000000)
end

local p = KEYS[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local shadow = ARGV[1] == '1'
local rid = ARGV[2]
local ttl = tonumber(ARGV[3])
local n = tonumber(ARGV[4])
if KEYS[2] and not shadow then
  local wait = cb_admit(KEYS[2], now)
  if wait then return '2 ' .. cb_int(now) .. ' ' .. cb_int(wait) end
end

local out = {'0', string.format('%d', now)}
local plan = {}
local ok = true
local longest = 0
local a = 5
for i = 1, n do
  local name, bms, nb, rolling = ARGV[a], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  local limit, cost, reserve = tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5]), ARGV[a + 6]
  a = a + 7
  local cur = rs_index(now, bms)
  local span = nb + rolling
  local keys = {}
  for j = 0, span - 1 do keys[j + 1] = rs_bucket(p, name, cur - j) end
  local vals = redis.call('MGET', unpack(keys))
  local used = 0
  for j = 1, span do
    local v = tonumber(vals[j]) or 0
    if j <= nb then used = used + v end
    out[#out + 1] = string.format('%d', v)
  end
  if rolling == 1 then
    -- ⌈B·w/b⌉ as ⌊B/b⌋·w + ⌈(B mod b)·w/b⌉: each product stays exact in Lua's doubles.
    local old, w = tonumber(vals[span]) or 0, bms - (now - cur * bms)
    local q = math.floor(old / bms)
    used = used + q * w + math.floor(((old - q * bms) * w + bms - 1) / bms)
  end
  local life = rs_life(bms, nb, rolling)
  if life > longest then longest = life end
  -- The cost as sent (an integer string): Lua would print a large number in exponent form.
  plan[i] = {keys[1], rs_window(name, bms, nb, rolling, cur), cost, ARGV[a - 2], life, reserve, used, limit}
end

local prompt, seqs = tonumber(ARGV[a]) or 0, tonumber(ARGV[a + 1]) or 0
local base, per_cap = tonumber(ARGV[a + 2]) or 0, tonumber(ARGV[a + 3]) or 0
local grant = nil
if seqs > 0 then
  for i = 1, n do
    local _, _, cost, _, _, reserve, used, limit = unpack(plan[i])
    if (reserve == '2' or reserve == '3') and used + cost > limit then
      local cap = 0
      if reserve == '2' then
        cap = math.floor((limit - used - prompt) / seqs)
      elseif per_cap > 0 and limit - used >= base then
        cap = muldiv(limit - used - base, per_cap)
      end
      if grant == nil or cap < grant then grant = cap end
    end
  end
end
if grant ~= nil and grant >= 1 then
  local cost = prompt + grant * seqs
  local money = money_cost(grant, base, per_cap)
  for i = 1, n do
    local reserve = plan[i][6]
    if reserve == '3' then
      -- Without money parts its cost stays the request's own worst case (the strict side).
      if per_cap > 0 then plan[i][3], plan[i][4] = money, string.format('%d', money) end
    elseif reserve ~= '0' then
      plan[i][3], plan[i][4] = cost, string.format('%d', cost)
    end
  end
else
  grant = 0
end
for i = 1, n do
  if plan[i][7] + plan[i][3] > plan[i][8] then ok = false end
end

if ok or shadow then
  local taken = {}
  local amount, money = '0', '0'
  for i = 1, n do
    local key, suffix, cost, sent, life, reserve = unpack(plan[i])
    if cost > 0 then
      redis.call('INCRBY', key, sent)
      redis.call('PEXPIRE', key, life)
      if reserve ~= '0' then
        taken[#taken + 1] = suffix
        if reserve == '3' then money = sent else amount = sent end
      end
    end
  end
  if #taken > 0 then
    local spec = table.concat(taken, ' ')
    -- The reservation, for the ledger's settlement (llmgw/settle.lua). Never given back by
    -- itself: one that is never settled stays charged as reserved.
    if rid ~= '' then rs_reserve(p, rid, amount, money, spec, ttl) end
    -- The tenant's token windows, for settling usage that had no reservation (admitted while
    -- this service was down or degraded, or settled after its reservation expired).
    redis.call('SET', rs_tspec(p), spec, 'PX', longest + ttl)
  end
end
if ok then out[1] = '1' end
out[#out + 1] = string.format('%d', grant)
return table.concat(out, ' ')
