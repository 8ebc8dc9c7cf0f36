--[[
  enqueue: put a handoff in its target agent's priority queue and ring the doorbell.
  Idempotent: a handoff already queued or in flight is left as it is.

  KEYS[1] queue   KEYS[2] inbox   KEYS[3] in-flight index   KEYS[4] sequence   KEYS[5] doorbell
  ARGV[1] handoff id   ARGV[2] priority (integer, -1000..1000; lower is served first)

  Returns 1 queued, 0 already queued or in flight.
  Events: one entry on KEYS[5] (MAXLEN 1) so blocked workers wake.
]]
local hid = ARGV[1]
if redis.call('ZSCORE', KEYS[1], hid) or redis.call('HEXISTS', KEYS[3], hid) == 1 then
  return 0
end
-- priority * 2^42 + seq stays exact in a double for |priority| <= 1000 and 4.4e12 enqueues
local score = tonumber(ARGV[2]) * 4398046511104 + redis.call('INCR', KEYS[4])
redis.call('ZADD', KEYS[1], score, hid)
redis.call('XADD', KEYS[5], 'MAXLEN', 1, '*', 'h', hid)
return 1
