--[[
  route: put a capability-routed handoff in its capability set's queue, to be pulled by a
  worker of any live agent that has every capability of the set. Idempotent: a handoff
  already queued keeps its place (its refusals and deferrals are updated); one claimed by a
  worker right now is left to that worker.

  KEYS[1] route queue   KEYS[2] route meta   KEYS[3] claims   KEYS[4] sequence (see includes/route.lua)
  ARGV[1] handoff id   ARGV[2] priority (-1000..1000, lower first)
  ARGV[3] deadline ms, or "+<ms>" for a new request: its timeout, counted from now
  ARGV[4] refused (",a,b," or ",")   ARGV[5] deferred (",a=<ms>," or ",")
  ARGV[6] ageing step ms: what one priority level is worth in waiting time
  ARGV[7] time the handoff was requested (ms; 0 = now: a new request, which leaves an entry
          already queued untouched, refusals and all)

  The score is (requested + priority * step) * 1024 + sequence mod 1024: lower priority
  numbers go first, but a request is overtaken only by requests of a better priority made
  less than (difference in priority * step) after it, so low priorities cannot starve.

  Returns 1 queued, 0 already queued (meta updated) or claimed (untouched).
]]
-- @include route

local hid = ARGV[1]
if redis.call('ZSCORE', KEYS[3], hid) then return 0 end
local score = redis.call('ZSCORE', KEYS[1], hid)
local since = tonumber(ARGV[7])
if score and since == 0 then return 0 end
local now = route_now()
local deadline = ARGV[3]
if string.sub(deadline, 1, 1) == '+' then deadline = string.format('%.0f', now + tonumber(string.sub(deadline, 2))) end
local queued = 0
if not score then
  if since == 0 then since = now end
  local seq = redis.call('INCR', KEYS[4]) % 1024
  score = string.format('%.0f', (since + tonumber(ARGV[2]) * tonumber(ARGV[6])) * 1024 + seq)
  redis.call('ZADD', KEYS[1], score, hid)
  queued = 1
end
redis.call('HSET', KEYS[2], hid, score .. '|' .. deadline .. '|' .. ARGV[4] .. '|' .. ARGV[5])
return queued
