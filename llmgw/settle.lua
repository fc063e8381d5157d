-- Settle one request's tokens, atomically and at most once (idempotent by request ID), at Redis's
-- own time, under the window rule of ratelimit/windows.py.
-- KEYS[1]: the tenant's key prefix (llmgw.wire.tenant_prefix). ARGV: request id, actual tokens,
-- done_ttl_ms, actual cost in micro-units (money budgets' windows, spend:*, settle it as token
-- windows settle the tokens). The keys are llmgw/reservation.lua's, prepended to this script.
-- The reservation ratelimit/admit.lua made holds the tokens reserved and each token window it
-- was charged to. With c the current bucket and N the window's buckets, per window:
--   * reserved bucket still counted whole (index > c − N): refund (n − actual) into it, or add
--     the excess (actual − n) to the current bucket;
--   * a fixed window's (a hard budget's) reserved bucket of an earlier day or month, while it
--     lives: the refund and the excess both go into it, so the cost stays with the budget that
--     admitted it;
--   * reserved bucket decaying (c − N) or gone (a stream about as long as its window, or longer):
--     charge the actual tokens to the current bucket and leave the reservation where it is. The
--     stream then counts in every window it ran in; the reservation counts on only while its
--     bucket decays (at most one bucket, the strict side). Refunding into the decaying bucket
--     instead would count the stream's tokens only at the decay's weight in the window it ended in.
-- Without a reservation (admitted fail-open or degraded, or expired) the actual tokens are charged
-- to the current buckets of the tenant's windows (rs_tspec), when known.
-- Buckets created here live as long as admit.lua's (rs_life).
-- Returns {1 reservation settled | 0 none | 2 already settled, tokens reserved, tokens charged,
-- the costs settled so far in each money window charged: "<name> <index> <micro-units> …"
-- (rs_settled: for the ledger's soft-limit alerts)}.
local p = KEYS[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rid = ARGV[1]
local actual = tonumber(ARGV[2])
local cost = tonumber(ARGV[4]) or 0
local done = rs_done(p, rid)
if redis.call('EXISTS', done) == 1 then return {2, 0, 0, ''} end
local n, m, spec = rs_reservation(p, rid)
local found = n and 1 or 0
local reserved = tonumber(n) or 0
local reserved_money = tonumber(m) or 0
if found == 0 then spec = redis.call('GET', rs_tspec(p)) end
local spent = {}
if spec and (found == 1 or actual > 0 or cost > 0) then
  for _, w in ipairs(rs_windows(spec)) do
    local name, bms, nb, rolling, idx = unpack(w)
    local cur = rs_index(now, bms)
    local money = rs_money(name)
    local held, used = reserved, actual
    if money then held, used = reserved_money, cost end
    local add = used
    -- Where the cost goes: the current bucket; a fixed window's (a budget's) stays with the
    -- day or month it was admitted in while that bucket lives, so that a request settled after
    -- midnight is charged against the budget that admitted it, never on top of the next one's.
    local target = cur
    local rk = rs_bucket(p, name, idx)
    if found == 1 and (idx > cur - nb or (rolling == 0 and redis.call('EXISTS', rk) == 1)) then
      add = used - held
      if rolling == 0 then target = idx end
      if add < 0 and redis.call('EXISTS', rk) == 1 then
        redis.call('DECRBY', rk, string.format('%d', -add))
      end
    end
    if add > 0 then
      local ckey = rs_bucket(p, name, target)
      redis.call('INCRBY', ckey, string.format('%d', add))
      if target == cur then redis.call('PEXPIRE', ckey, rs_life(bms, nb, rolling)) end
    end
    if money then
      local skey = rs_settled(p, name, target)
      local total = redis.call('INCRBY', skey, string.format('%d', used))
      redis.call('PEXPIRE', skey, rs_life(bms, nb, rolling))
      spent[#spent + 1] = name .. ' ' .. string.format('%d', target) .. ' ' .. string.format('%d', total)
    end
  end
end
if found == 1 then redis.call('DEL', rs_res(p, rid)) end
redis.call('SET', done, 1, 'PX', tonumber(ARGV[3]))
return {found, reserved, spec and actual or 0, table.concat(spent, ' ')}
