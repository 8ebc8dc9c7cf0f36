--[[
  take: settle finished handoffs, then move up to COUNT queued handoffs, best priority
  first, into the inbox stream and into this consumer's pending entries list, where they
  stay until settled (so a crashed consumer's work can be claimed by another).

  KEYS[1] queue   KEYS[2] inbox   KEYS[3] in-flight index   KEYS[4] sequence   KEYS[5] doorbell
  ARGV[1] consumer group   ARGV[2] consumer name   ARGV[3] count
  ARGV[4..] handoff ids to settle first (acknowledged and deleted from the inbox, and out of
            the in-flight index and the queue: see settle in includes/queue.lua)

  Returns {doorbell last id, handoff id, inbox entry id, ...} in serving order. When nothing
  was taken, block on KEYS[5] after the returned id: a later enqueue wakes the caller.
  A queued handoff already in the in-flight index leaves the queue and is not delivered
  again (nor counted in COUNT).
]]
-- @flags allow-oom
-- @include holder
-- @include queue

local group, consumer, count = ARGV[1], ARGV[2], tonumber(ARGV[3])
local done = {}
for i = 4, #ARGV do done[#done + 1] = ARGV[i] end
settle(group, done)

local out = {'0-0'}
local bell = redis.call('XREVRANGE', KEYS[5], '+', '-', 'COUNT', 1)
if bell[1] then out[1] = bell[1][1] end
if count <= 0 then return out end

-- a queued handoff already in flight here (admitted by a pull while also queued: a routed
-- handoff redirected here that its set's queue also held) is dropped, not delivered twice;
-- pop again for the places it took (each round removes what it pops, so this ends)
local hids = {}
while #hids < count do
  local popped = redis.call('ZPOPMIN', KEYS[1], math.min(count - #hids, SLICE))  -- SLICE: unpack's limit
  if #popped == 0 then break end
  local ids = {}
  for i = 1, #popped, 2 do ids[#ids + 1] = popped[i] end
  local flying = redis.call('HMGET', KEYS[3], unpack(ids))
  for i = 1, #ids do
    if not flying[i] then hids[#hids + 1] = ids[i] end
  end
end
return deliver(group, consumer, hids, out)
