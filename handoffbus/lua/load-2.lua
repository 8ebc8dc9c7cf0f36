--[[
  load: read what a worker needs to decide on a handoff it took, or a pending listing shows
  (read only). A script so
  that it travels in the same pipelines as the transitions.

  KEYS[1] record hash   <p>:{R}:h:<request_id>   KEYS[2] request envelope  <p>:{R}:e:<request_id>
  ARGV[1] optional: the largest envelope, in bytes, to return; a larger one is left out, for
          the caller to GET (a large value costs Redis far more passing through Lua than as a
          plain reply: see scripts.INLINE_ENVELOPE). The record's `esz` tells the size; a
          record without it (an envelope of 8 KB or less) always has its envelope returned.

  Returns {status, encoded request, owning agent, attempt, created ms, deadline ms, handoff id,
  from, to, routed, capability set, signature, server time ms, lease, left out}; the record's
  fields are false (nil) when it is gone. `left out` is 1 when the envelope was left out
  (the encoded request is then false), else 0. Handoff id to server time let a worker check a
  signed request before decoding it; the lease tells a running handler whether its hold
  still stands.
]]
-- @flags no-writes
local row = redis.call('HMGET', KEYS[1], 'status', 'env', 'agent', 'attempt', 'created', 'deadline', 'id',
  'from', 'to', 'routed', 'caps', 'rsig', 'lease', 'esz', 'sig')
local t = redis.call('TIME')
-- the request's signature: `rsig`; a PENDING record written before `rsig` was keeps it as `sig`
-- (once decided, `sig` is the deciding agent's response signature)
if not row[12] and row[1] == 'PENDING' then row[12] = row[15] end
local size = tonumber(row[14])  -- nil for a record written before its size was (or an old layout)
row[14] = row[13]
row[13] = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
row[15] = 0
if row[1] then
  if ARGV[1] and size and size > tonumber(ARGV[1]) then
    row[2], row[15] = false, 1
  else
    row[2] = redis.call('GET', KEYS[2]) or row[2]  -- or a pre-split record's own field
  end
end
return row
