-- A replica's heartbeat (ratelimit/failover.py), at Redis's own time: refresh this replica in the
-- sorted set, forget members not seen within seen_ms, and return how many replicas are left.
-- KEYS[1]: the set. ARGV: replica id, seen_ms.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local seen = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - seen)
redis.call('PEXPIRE', KEYS[1], seen)
return redis.call('ZCARD', KEYS[1])
