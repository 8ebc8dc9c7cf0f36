--[[
  guard: set routing guards again, for handoffs whose routing the caller could not make (the
  expiry sweep's, after their guard fired, when their set's node was out of reach): the next
  sweep after the guard routes them again. A guard of a handoff decided meanwhile is dropped
  by that sweep as a stale entry.

  KEYS[1] deadline index  <p>:{R}:deadlines
  ARGV[1] routing guard ms   ARGV[2..] request ids

  Returns how many guards were set.
]]
-- @flags allow-oom
local t = redis.call('TIME')
local at = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
for i = 2, #ARGV do
  redis.call('ZADD', KEYS[1], string.format('%.0f', at), 'o:' .. ARGV[i])
end
return #ARGV - 1
