-- Counts one replica made in process memory while Redis was out of reach, added to the tenant's
-- buckets (ratelimit/failover.py), at Redis's own time.
-- KEYS[1]: the tenant's key prefix (keys: llmgw/reservation.lua, prepended). ARGV: per bucket: name, bucket_ms, buckets, rolling (0/1),
-- bucket index, count. Buckets that already left their window are skipped; a key that cannot
-- be added to (WRONGTYPE) is skipped too, so one broken key never blocks the return to Redis.
-- Returns the number of buckets added.
local p = KEYS[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local added = 0
for a = 1, #ARGV - 5, 6 do
  local name, bms, span = ARGV[a], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]) + tonumber(ARGV[a + 3])
  local idx = tonumber(ARGV[a + 4])
  local gone = rs_start(idx + span, bms)  -- when the bucket has left the window entirely
  if gone > now then
    local key = rs_bucket(p, name, idx)
    if type(redis.pcall('INCRBY', key, ARGV[a + 5])) == 'number' then
      redis.call('PEXPIRE', key, gone + rs_life(bms, 0, 0) - now)
      added = added + 1
    end
  end
end
return added
