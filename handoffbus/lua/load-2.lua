--[[
  load: read what a worker needs to decide on the handoffs it took, or a pending listing shows
  (read only). A script so that it travels in the same pipelines as the transitions.

  KEYS[1] record hash   <p>:{R}:h:<request_id>   KEYS[2] request envelope  <p>:{R}:e:<request_id>
  and so on, a record and its envelope for each handoff to read: KEYS[2i-1], KEYS[2i] for the
  i-th. All of one requester {R} (one slot); a worker reads its batch in one call per requester
  (at most scripts.LOAD_MANY handoffs a call, see HandoffBus.load_records). An odd key last (the
  guard key a cluster call adds: see cluster.py) is not read.
  ARGV[1] optional: the largest envelope, in bytes, to return; a larger one is left out, for
          the caller to GET (a large value costs Redis far more passing through Lua than as a
          plain reply: see scripts.INLINE_ENVELOPE). The record's `esz` tells the size; a
          record without it (an envelope of 8 KB or less) always has its envelope returned.

  Returns, for each handoff in KEYS' order, its row of 15 values, the rows one after another in
  one flat reply (a call on two keys returns one row): {status, encoded request, owning agent,
  attempt, created ms, deadline ms, handoff id, from, to, routed, capability set, signature,
  server time ms, lease, left out}; the record's fields are false (nil) when it is gone.
  `left out` is 1 when the envelope was left out (the encoded request is then false), else 0.
  Handoff id to server time let a worker check a signed request before decoding it; the lease
  tells a running handler whether its hold still stands. The server time is the same in every
  row of a call.
]]
-- @flags no-writes
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out, n = {}, 0
for i = 1, #KEYS - 1, 2 do  -- (not a cluster call's guard key, last: see cluster.py)
  local row = redis.call('HMGET', KEYS[i], 'status', 'env', 'agent', 'attempt', 'created', 'deadline', 'id',
    'from', 'to', 'routed', 'caps', 'rsig', 'lease', 'esz', 'sig')
  -- the request's signature: `rsig`; a PENDING record written before `rsig` was keeps it as `sig`
  -- (once decided, `sig` is the deciding agent's response signature)
  if not row[12] and row[1] == 'PENDING' then row[12] = row[15] end
  local size = tonumber(row[14])  -- nil for a record written before its size was (or an old layout)
  local envelope, left = row[2], 0
  if row[1] then
    if ARGV[1] and size and size > tonumber(ARGV[1]) then
      envelope, left = false, 1
    else
      envelope = redis.call('GET', KEYS[i + 1]) or envelope  -- or a pre-split record's own field
    end
  end
  out[n + 1], out[n + 2] = row[1], envelope
  for j = 3, 12 do out[n + j] = row[j] end
  out[n + 13], out[n + 14], out[n + 15] = now, row[13], left
  n = n + 15
end
return out
