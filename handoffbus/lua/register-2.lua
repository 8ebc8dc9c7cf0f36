--[[
  register: a worker announces itself (on start and every heartbeat), or leaves.

  KEYS[1] worker index    <p>:{A}:workers   (hash consumer -> info JSON, beat = Redis time ms)
  KEYS[2] heartbeat key   <p>:{A}:w:<consumer>  (string, PX = time to live; gone = dead)
  ARGV[1] consumer   ARGV[2] info JSON (object without "beat_ms")   ARGV[3] time to live ms
          (0 = the worker leaves: both are removed)

  Returns the Redis time (ms) of this beat.
]]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if tonumber(ARGV[3]) == 0 then
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('DEL', KEYS[2])
  return now
end
-- the info is built by the client from validated names and numbers; the beat is appended here
local info = string.sub(ARGV[2], 1, -2) .. ',"beat_ms":' .. string.format('%.0f', now) .. '}'
redis.call('HSET', KEYS[1], ARGV[1], info)
redis.call('SET', KEYS[2], info, 'PX', ARGV[3])
return now
