--[[
  retire: delete consumers of an agent's group that are gone and hold nothing, so the group
  does not keep one consumer per worker process that ever ran.

  KEYS[1] inbox          <p>:{A}:inbox
  KEYS[2..] heartbeat keys <p>:{A}:w:<consumer>, one per name in ARGV[2..], same order
  ARGV[1] consumer group   ARGV[2..] consumer names

  A consumer is deleted only while its heartbeat key is gone (its worker left, or stopped
  beating) and it has no pending entry: XGROUP DELCONSUMER would drop pending entries from
  the group while they stay in the stream and the in-flight index, where nothing would ever
  deliver them again. A worker that was only late, and reads again, is recreated by its read.

  Returns the number of consumers deleted (0 when the group does not exist).
]]
-- @flags allow-oom
local deleted = 0
for i = 2, #ARGV do
  if KEYS[i] and redis.call('EXISTS', KEYS[i]) == 0 then
    local pending = redis.pcall('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[i])
    if pending.err then return deleted end  -- no inbox, or no group: no consumer to delete
    if #pending == 0 then
      redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[i])
      deleted = deleted + 1
    end
  end
end
return deleted
