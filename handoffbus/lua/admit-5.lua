--[[
  admit: a worker puts routed handoffs it pulled and was assigned into its agent's inbox,
  delivered to itself, exactly as `take` does for handoffs from the agent's own queue.
  Idempotent: a handoff already in flight here is skipped.

  KEYS[1] queue   KEYS[2] inbox   KEYS[3] in-flight index   KEYS[4] sequence   KEYS[5] doorbell
  ARGV[1] consumer group   ARGV[2] consumer name   ARGV[3..] handoff ids

  Returns {handoff id, inbox entry id, ...} for the handoffs admitted now.
]]
-- @include queue

local hids = {}
for i = 3, #ARGV do
  if redis.call('HEXISTS', KEYS[3], ARGV[i]) == 0 then hids[#hids + 1] = ARGV[i] end
end
return deliver(ARGV[1], ARGV[2], hids, {})
