--[[
  deadletter: move a taken handoff out of the agent's inbox into its dead-letter stream,
  with why and after how many deliveries; acknowledged in the same step, so workers carry
  on and nothing is lost (the dead letter names the handoff; its record stays).

  KEYS[1] inbox stream   <p>:{T}:inbox
  KEYS[2] in-flight index <p>:{T}:inflight
  KEYS[3] dead letters   <p>:{T}:dead  (stream; fields h, entry, reason, deliveries, consumer)
  ARGV[1] consumer group   ARGV[2] handoff id   ARGV[3] inbox entry id
  ARGV[4] reason           ARGV[5] deliveries   ARGV[6] consumer   ARGV[7] dead-letter cap (MAXLEN ~)

  Returns the dead-letter entry id.

  The in-flight index's entry goes too when it is another one held by this consumer, or not
  yet adopted (see includes/holder.lua): the group was deleted and
  restored since the handoff was taken, and ARGV[3] names nothing any more. Held by another
  consumer, it is a later delivery of the handoff, in that consumer's hands: left alone.
]]
-- @flags allow-oom
-- @include holder

local ids = {ARGV[3]}
local current = redis.call('HGET', KEYS[2], ARGV[2])
local index_mine = current == ARGV[3]
if current and not index_mine then
  index_mine = not held_elsewhere(KEYS[1], ARGV[1], current, ARGV[6])
  if index_mine then ids[2] = current end
end
redis.call('XACK', KEYS[1], ARGV[1], unpack(ids))
redis.call('XDEL', KEYS[1], unpack(ids))
if index_mine then redis.call('HDEL', KEYS[2], ARGV[2]) end
return redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[7], '*', 'h', ARGV[2], 'entry', ARGV[3],
  'reason', ARGV[4], 'deliveries', ARGV[5], 'consumer', ARGV[6])
