--[[
  pull: a worker with free slots takes routed handoffs it may be offered, best score first.
  Taken handoffs are claimed for a while: the worker then assigns them on their records and
  admits them to its own inbox, and acknowledges the claim in its next pull. A claim not
  acknowledged in time (the worker died in between) returns to the queue.

  KEYS[1] route queue   KEYS[2] route meta   KEYS[3] claims   KEYS[4] sequence (see includes/route.lua)
  ARGV[1] agent   ARGV[2] count   ARGV[3] claim time ms   ARGV[4] window: how many queued
  entries to read at a time (at most 1000). Entries this agent refused or deferred are skipped
  and stay queued; while fewer than count were taken, the next window behind them is read, up
  to WINDOWS (16) windows in all, so work queued behind many entries this agent may not take
  still reaches it, and a pull never reads more than 16 windows of the queue
  ARGV[5..] handoff ids whose claims this worker acknowledges first

  Returns {queued count after this pull, server time of the pull (ms), handoff id, ...}: the
  time is when the agent was chosen, recorded by `assign`. Entries past their deadline, or
  whose meta cannot be read, are dropped on the way (their records expire by themselves, or
  their routing guard routes them again).
]]
-- @flags allow-oom
-- @include offer
-- @include route

local agent, count = ARGV[1], tonumber(ARGV[2])
for i = 5, #ARGV do
  if redis.call('ZREM', KEYS[3], ARGV[i]) == 1 then redis.call('HDEL', KEYS[2], ARGV[i]) end
end
local now = route_now()
-- claims whose worker vanished go back where they were
local stale = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now, 'LIMIT', 0, 100)
for _, hid in ipairs(stale) do
  redis.call('ZREM', KEYS[3], hid)
  local meta = redis.call('HGET', KEYS[2], hid)
  local score = meta and parse_meta(meta)
  if score then redis.call('ZADD', KEYS[1], score, hid) elseif meta then redis.call('HDEL', KEYS[2], hid) end
end

local WINDOWS = 16
local out = {0, now}
if count > 0 then
  local window = math.min(tonumber(ARGV[4]), 1000)  -- 1000: unpack's limit, with room
  local claimed_until = now + tonumber(ARGV[3])
  -- rank of the next entry to read: the entries read and left queued come before it (the ones
  -- taken or dropped leave the queue, so the ranks behind them move up)
  local start = 0
  for _ = 1, WINDOWS do
    local head = redis.call('ZRANGE', KEYS[1], start, start + window - 1)
    if #head == 0 then break end
    local metas = redis.call('HMGET', KEYS[2], unpack(head))
    for i, hid in ipairs(head) do
      local meta = metas[i]
      local _, deadline, refused, deferred = '', 0, ',', ','
      if meta then _, deadline, refused, deferred = parse_meta(meta) end
      -- no meta, or one that cannot be read (written by hand): dropped, as past its deadline
      -- (the record's routing guard routes a live one again), never an error for every pull
      if not deadline or deadline <= now then
        redis.call('ZREM', KEYS[1], hid)
        redis.call('HDEL', KEYS[2], hid)
      elseif eligible(agent, refused, deferred, now) then
        redis.call('ZREM', KEYS[1], hid)
        redis.call('ZADD', KEYS[3], claimed_until, hid)
        out[#out + 1] = hid
        if #out - 2 >= count then break end
      else
        start = start + 1
      end
    end
    if #out - 2 >= count or #head < window then break end
  end
end
out[1] = redis.call('ZCARD', KEYS[1])
return out
