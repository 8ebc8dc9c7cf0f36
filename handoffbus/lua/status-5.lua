--[[
  status: read a handoff record; a PENDING one past its deadline is made EXPIRED first, so
  a read after the deadline never reports PENDING, whatever the sweep's timing.

  KEYS[1] record hash   KEYS[2] pending marker   KEYS[3] deadline index   KEYS[4] response stream
  KEYS[5] request envelope
  ARGV[1] request id    ARGV[2] record retention ms   ARGV[3] response stream retention ms
  ARGV[4] optional: the largest envelope, in bytes, to return; a larger one (the record's
          `esz` says) is left out for the caller to GET (see scripts.INLINE_ENVELOPE)

  Returns:
    {now ms, last response id, expired now (1/0), field, value, ...}  the record (HGETALL, with
       the envelope of KEYS[5] as its `env` field, unless left out);
       "expired now" tells the caller to take the handoff out of its target's queue

    {-1} no such handoff
  Events: EXPIRED on KEYS[4] when this read expired the handoff.
]]
-- @flags allow-oom
-- @include record

local rec = redis.call('HGETALL', KEYS[1])
if #rec == 0 then return {-1} end
local now = now_ms()
local expired = 0
if expire_if_due(KEYS, read_record(KEYS[1], {}), ARGV[1], now, tonumber(ARGV[2]), tonumber(ARGV[3])) then
  rec = redis.call('HGETALL', KEYS[1])
  expired = 1
end
local out = {fmt(now), last_response_id(KEYS[4]), expired}
local size
for i = 1, #rec do
  out[#out + 1] = rec[i]
  if rec[i] == 'esz' and i % 2 == 1 then size = tonumber(rec[i + 1]) end
end
if ARGV[4] and size and size > tonumber(ARGV[4]) then return out end
local envelope = redis.call('GET', KEYS[5])
if envelope then  -- else a pre-split record carries its own `env` field
  out[#out + 1] = 'env'
  out[#out + 1] = envelope
end
return out
