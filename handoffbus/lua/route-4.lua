--[[
  route: put a capability-routed handoff in its capability set's queue, to be pulled by a
  worker of any live agent that has every capability of the set. Idempotent: a handoff
  already queued keeps its place (its refusals and deferrals are merged in). A new request
  already queued or claimed is left alone; a handoff routed again (after a refusal or a lapse)
  while a worker holds a claim on it is queued again and the claim dropped.

  KEYS[1] route queue   KEYS[2] route meta   KEYS[3] claims   KEYS[4] sequence (see includes/route.lua)
  ARGV[1] handoff id   ARGV[2] priority (-1000..1000, lower first)
  ARGV[3] deadline ms, or "+<ms>" for a new request: its timeout, counted from now
  ARGV[4] refused (",a,b," or ",")   ARGV[5] deferred (",a=<ms>," or ","): merged with the
          ones the meta already holds (a refusal is never dropped, a deferral keeps its later time)
  ARGV[6] ageing step ms: what one priority level is worth in waiting time
  ARGV[7] time the handoff was requested (ms; 0 = now: a new request, which leaves an entry
          already queued untouched, refusals and all)

  The score is (requested + priority * step) * 1024 + tick mod 1024: lower priority
  numbers go first, but a request is overtaken only by requests of a better priority made
  less than (difference in priority * step) after it, so low priorities cannot starve.
  KEYS[4] is the set's routing clock, the last tick issued in 1/1024 ms (ms * 1024 + n):
  each route takes the next tick, and never one before the first of TIME's millisecond. A new
  request's "requested" is its tick's millisecond, so requests of one priority are served in
  the order they were routed, however many fall in one millisecond (past 1024, the ticks run
  on into the next millisecond). A handoff routed again keeps its requested time, with its
  tick's n as the tie-break.

  Returns 1 queued, 0 already queued (meta updated), or a new request already routed.
]]
-- @include offer
-- @include route

local hid = ARGV[1]
local since = tonumber(ARGV[7])
if redis.call('ZSCORE', KEYS[3], hid) then
  if since == 0 then return 0 end
  -- routed again while a worker holds a claim on it: queue it, and drop the claim so that the
  -- worker's acknowledgement leaves the queued entry alone (`assign` lets one agent win)
  redis.call('ZREM', KEYS[3], hid)
end
local score = redis.call('ZSCORE', KEYS[1], hid)
if score and since == 0 then return 0 end
local now = route_now()
local deadline = ARGV[3]
if string.sub(deadline, 1, 1) == '+' then deadline = string.format('%.0f', now + tonumber(string.sub(deadline, 2))) end
-- lists read from a record: one written by hand (or by a requester's own user) must not put a
-- '|' in the meta, which no pull could read
local refused, deferred = agent_list(ARGV[4]), agent_list(ARGV[5])
local meta = redis.call('HGET', KEYS[2], hid)
local _, _, old_refused, old_deferred
if meta then _, _, old_refused, old_deferred = parse_meta(meta) end
if old_refused then
  refused, deferred = merge_meta(refused, deferred, old_refused, old_deferred)
end
local queued = 0
if not score then
  -- the next tick of the routing clock (a counter below TIME's: one left by an earlier version,
  -- or a clock that fell behind, starts again at this millisecond's first tick)
  local tick = redis.call('INCR', KEYS[4])
  if tick < now * 1024 then
    tick = now * 1024
    redis.call('SET', KEYS[4], string.format('%.0f', tick))
  end
  if since == 0 then since = math.floor(tick / 1024) end
  score = string.format('%.0f', (since + tonumber(ARGV[2]) * tonumber(ARGV[6])) * 1024 + tick % 1024)
  redis.call('ZADD', KEYS[1], score, hid)
  queued = 1
end
redis.call('HSET', KEYS[2], hid, score .. '|' .. deadline .. '|' .. refused .. '|' .. deferred)
return queued
