--[[
  sweep: expire every PENDING handoff of one requester whose deadline has passed, in a batch.
  Run by whichever bus holds the sweep lease; the scripts' own expiry checks keep every
  other path exact, so the sweep only decides how soon an idle requester hears EXPIRED.

  KEYS[1] deadline index  <p>:{R}:deadlines
  ARGV[1] key prefix of R's slot, e.g. "hb:{agent-1}:" (records and markers are built from it;
          they share KEYS[1]'s hash tag, so the script stays in one slot)
  ARGV[2] batch size      ARGV[3] record retention ms      ARGV[4] response stream retention ms

  Returns {expired count, handoff id, to agent, ...} for the handoffs expired now, so the
  caller can remove them from their target queues.
  Events: EXPIRED on <p>:{R}:responses for each.
]]
-- @include record

local base = ARGV[1]
local retention_ms, response_retention_ms = tonumber(ARGV[3]), tonumber(ARGV[4])
local now = now_ms()
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', fmt(now), 'LIMIT', 0, tonumber(ARGV[2]))
local out = {0}
for _, request_id in ipairs(due) do
  local keys = {base .. 'h:' .. request_id, base .. 'p:' .. request_id, KEYS[1], base .. 'responses'}
  local rec = read_record(keys[1], {'to'})
  if rec.status ~= 'PENDING' then
    redis.call('ZREM', KEYS[1], request_id)  -- decided or gone: a stale index entry
  elseif expire_if_due(keys, rec, request_id, now, retention_ms, response_retention_ms) then
    out[1] = out[1] + 1
    out[#out + 1] = rec.id
    out[#out + 1] = rec.to
  end
  -- else the marker outlives TIME by under a millisecond: the next pass takes it
end
return out
