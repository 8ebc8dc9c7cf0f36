--[[
  observe: what an operator wants to know of one agent's work, read in one go (changes nothing).

  KEYS[1] queue   KEYS[2] inbox   KEYS[3] in-flight index   KEYS[4] sequence   KEYS[5] doorbell
  (see includes/queue.lua)   KEYS[6] stats hash <p>:{A}:stats (see handoffbus/stats.py)
  ARGV[1] how many priority bands to report the head of from each end of the queue: that many
          of the lowest priority numbers (served first) and that many of the highest (served
          last, so the likeliest to starve), each band once. The queue serves a band first in,
          first out, so its head is its oldest handoff. Cost: O(ARGV[1] * log n), never a scan.

  Returns {queued, in flight, oldest in-flight inbox entry id (or ""), Redis time ms,
           {stats field, value, ...}, {band head handoff id, score, ...}}
           (the heads of the lowest bands in ascending order, then of the highest in descending)
  The caller reads the heads' records (in their requesters' slots) for their ages.
]]
-- @flags no-writes
local queued = redis.call('ZCARD', KEYS[1])
local inflight = redis.call('HLEN', KEYS[3])
local first = redis.call('XRANGE', KEYS[2], '-', '+', 'COUNT', 1)
local oldest = first[1] and first[1][1] or ''
local t = redis.call('TIME')
local now = string.format('%.0f', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))

local band_size = 4398046511104  -- 2^42: a score is priority * 2^42 + sequence (see enqueue-5.lua)
local bands = tonumber(ARGV[1])
local heads = {}
-- the first queued handoff at or above `score`, added to heads; its band, or nil if none
local function head_from(score)
  local found = redis.call('ZRANGEBYSCORE', KEYS[1], score, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
  if not found[1] then return nil end
  heads[#heads + 1] = found[1]
  heads[#heads + 1] = found[2]
  return math.floor(tonumber(found[2]) / band_size)
end
-- the lowest bands, upwards (last_band: the highest walked; nil once every band was)
local from, last_band = '-inf', nil
for _ = 1, bands do
  last_band = head_from(from)
  if not last_band then break end
  from = string.format('%.0f', (last_band + 1) * band_size)
end
-- the highest bands, downwards, until they meet the ones walked upwards (ZRANGE BYSCORE REV: the
-- ACL users of `handoffbus acl` may run ZRANGE, not ZREVRANGEBYSCORE)
local to = '+inf'
for _ = 1, last_band and bands or 0 do
  local top = redis.call('ZRANGE', KEYS[1], to, '-inf', 'BYSCORE', 'REV', 'LIMIT', 0, 1, 'WITHSCORES')
  if not top[1] then break end
  local band = math.floor(tonumber(top[2]) / band_size)
  if band <= last_band then break end
  local start = string.format('%.0f', band * band_size)
  head_from(start)
  to = '(' .. start
end
return {queued, inflight, oldest, now, redis.call('HGETALL', KEYS[6]), heads}
