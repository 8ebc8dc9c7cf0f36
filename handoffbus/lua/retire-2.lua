--[[
  retire: forget workers of an agent that are gone: delete their consumers that hold nothing
  from the group, so the group does not keep one consumer per worker process that ever ran,
  and their entries from the worker index, which a worker that died (never leaving) kept for
  ever on a bus where nothing lists the agents.

  KEYS[1] inbox          <p>:{A}:inbox
  KEYS[2] worker index   <p>:{A}:workers
  KEYS[3..] heartbeat keys <p>:{A}:w:<consumer>, one per name in ARGV[2..], same order
  ARGV[1] consumer group   ARGV[2..] consumer names

  A worker is gone while its heartbeat key is gone (its worker left, or stopped beating). Its
  consumer is deleted only if it has no pending entry: XGROUP DELCONSUMER would drop pending
  entries from the group while they stay in the stream and the in-flight index, where nothing
  would ever deliver them again. A worker that was only late is listed again by its next beat,
  and its consumer recreated by its read.

  Returns the number of consumers deleted (0 when the group does not exist).
]]
-- @flags allow-oom
local deleted, group = 0, true
for i = 2, #ARGV do
  if KEYS[i + 1] and redis.call('EXISTS', KEYS[i + 1]) == 0 then
    redis.call('HDEL', KEYS[2], ARGV[i])
    if group then
      local pending = redis.pcall('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[i])
      if pending.err then
        group = false  -- no inbox, or no group: no consumer to delete
      elseif #pending == 0 then
        redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[i])
        deleted = deleted + 1
      end
    end
  end
end
return deleted
