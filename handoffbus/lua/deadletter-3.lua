--[[
  deadletter: move a taken handoff out of the agent's inbox into its dead-letter stream,
  with why and after how many deliveries; acknowledged in the same step, so workers carry
  on and nothing is lost (the dead letter names the handoff; its record stays).

  KEYS[1] inbox stream   <p>:{T}:inbox
  KEYS[2] in-flight index <p>:{T}:inflight
  KEYS[3] dead letters   <p>:{T}:dead  (stream; fields h, entry, reason, deliveries, consumer[, keep])
  ARGV[1] consumer group   ARGV[2] handoff id   ARGV[3] inbox entry id
  ARGV[4] reason           ARGV[5] deliveries   ARGV[6] consumer   ARGV[7] dead-letter cap
  ARGV[8] "1": keep it past the cap (its handoff may be ACCEPTED: no deadline ends it, so
          this dead letter is all that does); absent or anything else: trimmable

  Returns the dead-letter entry id.

  The cap: past ARGV[7] entries, the oldest are deleted, but never a kept one ("keep" "1"),
  which stays until it is replayed or failed; so kept ones do not count against the cap's
  deletions, at most CAP_STEP a call (a lowered cap is reached over the next calls).

  The in-flight index's entry goes too when it is another one held by this consumer, or not
  yet adopted (see includes/holder.lua): the group was deleted and
  restored since the handoff was taken, and ARGV[3] names nothing any more. Held by another
  consumer, it is a later delivery of the handoff, in that consumer's hands: left alone.
]]
-- @flags allow-oom
-- @include holder

local CAP_STEP = 1000

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

local fields = {'h', ARGV[2], 'entry', ARGV[3], 'reason', ARGV[4], 'deliveries', ARGV[5], 'consumer', ARGV[6]}
if ARGV[8] == '1' then fields[#fields + 1] = 'keep'; fields[#fields + 1] = '1' end
local id = redis.call('XADD', KEYS[3], '*', unpack(fields))

-- the cap, oldest first, skipping the kept ones (and this one: the newest stays)
local over = math.min(redis.call('XLEN', KEYS[3]) - tonumber(ARGV[7]), CAP_STEP)
local from = '-'
while over > 0 do
  local rows = redis.call('XRANGE', KEYS[3], from, '(' .. id, 'COUNT', CAP_STEP)
  if #rows == 0 then break end
  local doomed = {}
  for _, row in ipairs(rows) do
    local kept, f = false, row[2]
    for i = 1, #f, 2 do
      if f[i] == 'keep' and f[i + 1] == '1' then kept = true end
    end
    if not kept and #doomed < over then doomed[#doomed + 1] = row[1] end
  end
  if #doomed > 0 then
    redis.call('XDEL', KEYS[3], unpack(doomed))
    over = over - #doomed
  end
  from = '(' .. rows[#rows][1]
end
return id
