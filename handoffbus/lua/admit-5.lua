--[[
  admit: a worker puts routed handoffs it pulled and was assigned into its agent's inbox,
  delivered to itself, exactly as `take` does for handoffs from the agent's own queue. Also
  how a replayed ACCEPTED dead letter is re-issued: delivered to RESTORED, for a live worker
  to take over once idle (client.replay_dead_letter).
  Idempotent: a handoff already in flight here, or named twice, is admitted once. A named
  handoff also queued in KEYS[1] (redirected here by a refusal while its set's queue held it
  too) leaves that queue, so that `take` does not deliver it a second time.

  KEYS[1] queue   KEYS[2] inbox   KEYS[3] in-flight index   KEYS[4] sequence   KEYS[5] doorbell
  ARGV[1] consumer group   ARGV[2] consumer name   ARGV[3..] handoff ids

  Returns {handoff id, inbox entry id, ...} for the handoffs admitted now.
]]
-- @flags allow-oom
-- @include holder
-- @include queue

local hids, seen = {}, {}
for i = 3, #ARGV do
  -- once each: a repeat would get a second entry, and the index only the last of them
  if not seen[ARGV[i]] and redis.call('HEXISTS', KEYS[3], ARGV[i]) == 0 then hids[#hids + 1] = ARGV[i] end
  seen[ARGV[i]] = true
end
-- in flight here now (or already): a copy in the agent's own queue is not served again
for first = 3, #ARGV, SLICE do redis.call('ZREM', KEYS[1], unpack(ARGV, first, math.min(first + SLICE - 1, #ARGV))) end
return deliver(ARGV[1], ARGV[2], hids, {})
