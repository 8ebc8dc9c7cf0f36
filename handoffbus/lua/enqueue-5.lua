--[[
  enqueue: put a handoff in its target agent's priority queue and ring the doorbell.
  Idempotent: a handoff already queued or in flight is left as it is.

  KEYS[1] queue   KEYS[2] inbox   KEYS[3] in-flight index   KEYS[4] sequence   KEYS[5] doorbell
  ARGV[1] handoff id   ARGV[2] priority (integer, -1000..1000; lower is served first)
  ARGV[3] cap: refuse a new entry while the agent has this many handoffs queued or in
          flight (0 = no cap; only new requests pass one: work coming back is never refused)

  Returns 1 queued, 0 already queued or in flight, -7 the agent's queue is at its cap.
  Events: one entry on KEYS[5] (MAXLEN 1) when the queue was empty, so blocked workers wake.
  A worker blocks on the doorbell only after a take found the queue empty, so the first
  handoff queued after that rings it; ringing for the others would wake no one. (requeue,
  the only other script that fills the queue, always rings.)
]]
local hid = ARGV[1]
if redis.call('ZSCORE', KEYS[1], hid) or redis.call('HEXISTS', KEYS[3], hid) == 1 then
  return 0
end
local queued = redis.call('ZCARD', KEYS[1])
local cap = tonumber(ARGV[3] or 0)
if cap > 0 and queued + redis.call('HLEN', KEYS[3]) >= cap then return -7 end
-- priority * 2^42 + seq stays exact in a double for |priority| <= 1000 and 4.4e12 enqueues
local score = tonumber(ARGV[2]) * 4398046511104 + redis.call('INCR', KEYS[4])
redis.call('ZADD', KEYS[1], score, hid)
if queued == 0 then redis.call('XADD', KEYS[5], 'MAXLEN', 1, '*', 'h', hid) end
return 1
