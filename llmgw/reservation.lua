-- A tenant's counters in Redis, and the reservation admission leaves for settlement to find
-- (llmgw/reservation.py): prepended to ratelimit/admit.lua and ratelimit/replay.lua, which
-- write them, and to llmgw/settle.lua, which settles them. Every key starts with the tenant's
-- prefix p (llmgw.wire.tenant_prefix: one hash tag, one Redis Cluster slot):
--   p:<check>:<bucket index>  a window's bucket (check: "tokens:minute"), its count
--   p:res:<request id>        a reservation, a hash: n = tokens reserved, s = the windows
--                             charged (rs_window, space separated)
--   p:tspec                   the tenant's token windows (the s of its latest reservation), for
--                             usage settled without one
--   p:done:<request id>       a settled request: settlement runs at most once per request

local function rs_bucket(p, name, idx) return p .. ':' .. name .. ':' .. string.format('%d', idx) end
local function rs_res(p, rid) return p .. ':res:' .. rid end
local function rs_tspec(p) return p .. ':tspec' end
local function rs_done(p, rid) return p .. ':done:' .. rid end

-- How long a bucket lives: the window's buckets, the decaying one of a rolling window, and one
-- more, so it outlives every decision that reads it.
local function rs_life(bms, nb, rolling) return (nb + rolling + 1) * bms end

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

-- The reservation of request rid: written by admission, read (n, s; nil when none) by settlement.
local function rs_reserve(p, rid, n, spec, ttl)
  local key = rs_res(p, rid)
  redis.call('HSET', key, 'n', n, 's', spec)
  redis.call('PEXPIRE', key, ttl)
end

local function rs_reservation(p, rid)
  local r = redis.call('HMGET', rs_res(p, rid), 'n', 's')
  return r[1], r[2]
end
