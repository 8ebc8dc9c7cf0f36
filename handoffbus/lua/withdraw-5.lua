--[[
  withdraw: remove a PENDING handoff that its `request` call has just created, because its
  target refused it (queue at its cap): nothing was queued or sent, so nothing is left
  behind and the caller may retry with the same request id later.

  KEYS[1] record hash   KEYS[2] pending marker   KEYS[3] deadline index   KEYS[4] response stream
  KEYS[5] request envelope
  ARGV[1] request id

  Returns 1 removed, 0 left alone: no longer PENDING, or `joined` (the same request was sent
  again meanwhile and found it PENDING: that caller may have queued it and awaits it). If that
  caller's queue entry was refused too, the record stays PENDING and unqueued until the same
  request is sent again (and queued) or its deadline expires it: nothing is lost either way.
]]
-- @flags allow-oom
local rec = redis.call('HMGET', KEYS[1], 'status', 'joined')
if rec[1] ~= 'PENDING' or rec[2] then return 0 end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[5])
redis.call('ZREM', KEYS[3], ARGV[1], 'o:' .. ARGV[1])
return 1
