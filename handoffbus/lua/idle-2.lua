--[[
  idle: whether a requester may leave the requesters set, which the sweep walks on every
  pass: nothing in its deadline index (no undecided handoff, routing guard or settle entry)
  and nothing written to its response stream for ARGV[1] ms. Its next request lists it again.

  KEYS[1] deadline index   <p>:{R}:deadlines
  KEYS[2] response stream  <p>:{R}:responses  (an entry id's first part is when it was written)
  ARGV[1] idle ms

  Returns 1 idle, 0 not (an entry id not of the form "<ms>-<seq>": not idle).
]]
-- @flags no-writes
-- @include record

if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
if #last == 0 then return 1 end
local written = tonumber(string.match(last[1][1], '^(%d+)-'))
if written and written + tonumber(ARGV[1]) <= now_ms() then return 1 end
return 0
