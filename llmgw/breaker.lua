-- The per-tenant breaker's rule (llmgw/breaker.py), prepended to ratelimit/admit.lua, which
-- enforces it, to ledger/breaker.lua, which feeds it outcomes, and to admin/breaker.lua, which
-- reads it for the operator: all read the state alike.
-- One hash per tenant, `<tenant prefix>:cb` (the hash tag of the tenant's counters):
--   s, m    the decaying scores: the tenant's failures and its mistakes (4xx)
--   t       the time (ms) both were brought to
--   o       while tripped: the end (ms) of the cool-down; the recovery steps follow it
--   cd      that cool-down's length (ms), which a re-open grows
--   at      the episode's first trip (ms), for the time to recover
--   sm, p   recovery: each step's length (ms) and the shares it admits per mille ("100 300
--           1000"), fixed at the trip
--   c, cs   requests seen in half-open step cs ("<o>:<k>")
-- Nothing moves by itself: the phase at `now` follows from o, sm and p. A step that ran its
-- length without a re-open stayed below the threshold (a re-open moves o), so it passed.

local function cb_steps(p)
  local out = {}
  for v in string.gmatch(p or '', '%d+') do out[#out + 1] = tonumber(v) end
  return out
end

-- 'closed'; 'open', the cool-down's end; 'half', step k, its share per mille, its end;
-- 'recovered', when (the end of the last step).
local function cb_phase(o, sm, steps, now)
  if not o then return 'closed' end
  if now < o then return 'open', o end
  local k = math.floor((now - o) / sm) + 1
  if k > #steps then return 'recovered', o + #steps * sm end
  return 'half', k, steps[k], o + k * sm
end

local function cb_int(x) return string.format('%d', x) end

-- Admission: nil when the breaker lets the request through, else the wait (ms) to suggest.
-- Half-open: the c-th request of a step (from 0) passes when ⌊c·share/1000⌋ moves, so the
-- first does, then one in every 1000/share: deterministic across replicas (one counter).
local function cb_admit(key, now)
  local f = redis.call('HMGET', key, 'o', 'sm', 'p', 'c', 'cs')
  local o = tonumber(f[1])
  if not o then return nil end
  local phase, x, share, ends = cb_phase(o, tonumber(f[2]), cb_steps(f[3]), now)
  if phase == 'open' then return x - now end
  if phase ~= 'half' then return nil end
  local step = f[1] .. ':' .. x
  local c = (f[5] == step) and tonumber(f[4]) or 0
  redis.call('HSET', key, 'c', c + 1, 'cs', step)
  if math.floor(c * share / 1000) ~= math.floor((c - 1) * share / 1000) then return nil end
  return ends - now
end

-- The state at `now`, read only (the admin API: admin/breaker.lua): no HSET, no count of a
-- half-open step's requests (cb_admit's), no expiry moved. Returns the phase ('closed', 'open',
-- 'half', 'recovered': a recovery no feed has cleaned up yet), then, tripped, its end (ms: the
-- cool-down's, or the current step's), the step's share per mille ('' while open), the
-- episode's first trip (ms) and its cool-down (ms); '' where there is none.
local function cb_state(key, now)
  local f = redis.call('HMGET', key, 'o', 'sm', 'p', 'at', 'cd')
  local phase, x, share, ends = cb_phase(tonumber(f[1]), tonumber(f[2]), cb_steps(f[3]), now)
  if phase == 'open' then return {phase, cb_int(x), '', f[4] or '', f[5] or ''} end
  if phase == 'half' then return {phase, cb_int(ends), cb_int(share), f[4] or '', f[5] or ''} end
  return {phase, '', '', '', ''}
end

-- Outcomes: a = threshold, recovery threshold, mistakes threshold, λ per ms, cool-down ms,
-- growth, longest cool-down ms, step ms, shares per mille, then (weight, score 's' or 'm',
-- cause) per outcome in arrival order.
-- Outcomes that arrive while open (requests admitted before the trip) count nothing.
-- Returns the transitions: "trip <ms> <cause> <cool-down ms> <reopen 0/1> <first trip ms>"
-- and "recover <ms> <first trip ms>".
local function cb_feed(key, now, a)
  local f = redis.call('HMGET', key, 's', 'm', 't', 'o', 'cd', 'at', 'sm', 'p')
  local s, m, t = tonumber(f[1]) or 0, tonumber(f[2]) or 0, tonumber(f[3]) or now
  local o, cd, at = tonumber(f[4]), tonumber(f[5]), f[6]
  local threshold, again, mistakes = tonumber(a[1]), tonumber(a[2]), tonumber(a[3])
  local lambda, base, growth, longest = tonumber(a[4]), tonumber(a[5]), tonumber(a[6]), tonumber(a[7])
  local events = {}
  local phase, x = cb_phase(o, tonumber(f[7]), cb_steps(f[8]), now)
  if phase == 'recovered' then
    events[#events + 1] = 'recover ' .. cb_int(x) .. ' ' .. at
    redis.call('HDEL', key, 'o', 'cd', 'at', 'sm', 'p', 'c', 'cs')
    phase = 'closed'
  end
  local scored = false
  for i = 10, #a - 2, 3 do
    local w = tonumber(a[i])
    if w > 0 and phase ~= 'open' then
      local decay = math.exp(-lambda * (now - t))
      s, m, t = s * decay, m * decay, now
      scored = true
      local tripped
      if a[i + 1] == 'm' then
        m = m + w
        tripped = m >= mistakes
      else
        s = s + w
        tripped = s >= (phase == 'half' and again or threshold)
      end
      if tripped then
        local reopen = phase == 'half'
        cd = reopen and math.min(math.floor(cd * growth), longest) or base
        if not reopen then at = cb_int(now) end
        s, m = 0, 0
        redis.call('HSET', key, 'o', cb_int(now + cd), 'cd', cb_int(cd), 'at', at, 'sm', a[8], 'p', a[9])
        events[#events + 1] = 'trip ' .. cb_int(now) .. ' ' .. a[i + 2] .. ' ' .. cb_int(cd) .. ' ' .. (reopen and '1' or '0') .. ' ' .. at
        phase = 'open'
      end
    end
  end
  if scored then
    redis.call('HSET', key, 's', string.format('%.17g', s), 'm', string.format('%.17g', m), 't', cb_int(t))
  end
  -- A tenant whose breaker is quiet for a day is forgotten (its scores are long ~0 by then).
  redis.call('PEXPIRE', key, 86400000)
  return events
end
