--[[
  observe: what an operator wants to know of one agent's work, read in one go (changes nothing).

  KEYS[1] queue   KEYS[2] inbox   KEYS[3] in-flight index   KEYS[4] sequence   KEYS[5] doorbell
  (see includes/queue.lua)   KEYS[6] stats hash <p>:{A}:stats (see handoffbus/stats.py)
  ARGV[1] how many priority bands to report the head of (the queue serves a band first in,
          first out, so its head is its oldest handoff)

  Returns {queued, in flight, oldest in-flight inbox entry id (or ""), Redis time ms,
           {stats field, value, ...}, {band head handoff id, score, ...}}
  The caller reads the heads' records (in their requesters' slots) for their ages.
]]
local queued = redis.call('ZCARD', KEYS[1])
local inflight = redis.call('HLEN', KEYS[3])
local first = redis.call('XRANGE', KEYS[2], '-', '+', 'COUNT', 1)
local oldest = first[1] and first[1][1] or ''
local t = redis.call('TIME')
local now = string.format('%.0f', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))

local band_size = 4398046511104  -- 2^42: a score is priority * 2^42 + sequence (see enqueue-5.lua)
local heads, from = {}, '-inf'
for _ = 1, tonumber(ARGV[1]) do
  local found = redis.call('ZRANGEBYSCORE', KEYS[1], from, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
  if not found[1] then break end
  heads[#heads + 1] = found[1]
  heads[#heads + 1] = found[2]
  from = string.format('%.0f', (math.floor(tonumber(found[2]) / band_size) + 1) * band_size)
end
return {queued, inflight, oldest, now, redis.call('HGETALL', KEYS[6]), heads}
