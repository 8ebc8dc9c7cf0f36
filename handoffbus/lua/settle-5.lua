--[[
  settle: take handoffs that reached a decision or an end out of their target's queue and
  inbox (remove from the queue; acknowledge and delete the in-flight entry).

  KEYS[1] queue   KEYS[2] inbox   KEYS[3] in-flight index   KEYS[4] sequence   KEYS[5] doorbell
  ARGV[1] consumer group   ARGV[2..] handoff ids

  Returns the number of queue members and inbox entries removed.
]]
-- @flags allow-oom
-- @include holder
-- @include queue

local hids = {}
for i = 2, #ARGV do hids[#hids + 1] = ARGV[i] end
return settle(ARGV[1], hids)
