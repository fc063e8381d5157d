-- A tenant's counters in Redis, and the reservation admission leaves for settlement to find
-- (llmgw/reservation.py): prepended to ratelimit/admit.lua and ratelimit/replay.lua, which
-- write them, and to llmgw/settle.lua, which settles them. Every key starts with the tenant's
-- prefix p (llmgw.wire.tenant_prefix: one hash tag, one Redis Cluster slot):
--   p:<check>:<bucket index>  a window's bucket (check: "tokens:minute"), its count
--   p:res:<request id>        a reservation, a hash: n = tokens reserved, m = micro-units
--                             reserved (money budgets' windows, named spend:*), s = the
--                             windows charged (rs_window, space separated)
--   p:tspec                   the tenant's token windows (the s of its latest reservation), for
--                             usage settled without one
--   p:done:<request id>       a settled request: settlement runs at most once per request
--   p:settled:<check>:<index> a money budget window's settled costs alone (no reservations),
--                             for its soft-limit alerts

local function rs_bucket(p, name, idx) return p .. ':' .. name .. ':' .. string.format('%d', idx) end
local function rs_res(p, rid) return p .. ':res:' .. rid end
local function rs_tspec(p) return p .. ':tspec' end
local function rs_done(p, rid) return p .. ':done:' .. rid end
local function rs_settled(p, name, idx) return p .. ':settled:' .. name .. ':' .. string.format('%d', idx) end

-- Buckets of bucket_ms 0 are UTC calendar months (money budgets): index year × 12 + month − 1,
-- from the day number by H. Hinnant's civil-date algorithm (ratelimit/types.py month_index).
local function rs_month(ms)
  local z = math.floor(ms / 86400000) + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return y * 12 + m - 1
end

local function rs_month_start(idx)
  local y, m = math.floor(idx / 12), idx % 12 + 1
  if m <= 2 then y = y - 1 end
  local era = math.floor(y / 400)
  local yoe = y - era * 400
  local mp = m > 2 and m - 3 or m + 9
  local doe = yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + math.floor((153 * mp + 2) / 5)
  return (era * 146097 + doe - 719468) * 86400000
end

-- The bucket an instant falls in, and when a bucket begins.
local function rs_index(now, bms)
  if bms == 0 then return rs_month(now) end
  return math.floor(now / bms)
end

local function rs_start(idx, bms)
  if bms == 0 then return rs_month_start(idx) end
  return idx * bms
end

-- How long a bucket lives: the window's buckets, the decaying one of a rolling window, and one
-- more, so it outlives every decision that reads it (a month's: two of the longest months).
local function rs_life(bms, nb, rolling)
  if bms == 0 then return 62 * 86400000 end
  return (nb + rolling + 1) * bms
end

-- A money budget's window: its reservation and settlement are in micro-units, not tokens.
local function rs_money(name) return string.sub(name, 1, 6) == 'spend:' end

-- One window a reservation was charged to, and the windows of a spec back.
local function rs_window(name, bms, nb, rolling, idx)
  return name .. ' ' .. bms .. ' ' .. nb .. ' ' .. rolling .. ' ' .. string.format('%d', idx)
end

local function rs_windows(spec)
  local f, out = {}, {}
  for w in string.gmatch(spec, '%S+') do f[#f + 1] = w end
  for i = 1, #f - 4, 5 do
    out[#out + 1] = {f[i], tonumber(f[i + 1]), tonumber(f[i + 2]), tonumber(f[i + 3]), tonumber(f[i + 4])}
  end
  return out
end

-- The reservation of request rid: written by admission, read (n, m, s; nil when none) by
-- settlement.
local function rs_reserve(p, rid, n, m, spec, ttl)
  local key = rs_res(p, rid)
  redis.call('HSET', key, 'n', n, 'm', m, 's', spec)
  redis.call('PEXPIRE', key, ttl)
end

local function rs_reservation(p, rid)
  local r = redis.call('HMGET', rs_res(p, rid), 'n', 'm', 's')
  return r[1], r[2], r[3]
end
