--[[
  load: read what a worker needs to decide on a handoff it took, or a pending listing shows
  (read only). A script so
  that it travels in the same pipelines as the transitions.

  KEYS[1] record hash   <p>:{R}:h:<request_id>   KEYS[2] request envelope  <p>:{R}:e:<request_id>

  Returns {status, encoded request, owning agent, attempt, created ms, deadline ms, handoff id,
  from, to, routed, capability set, signature, server time ms, lease}; the record's fields are
  false (nil) when it is gone. Handoff id to server time let a worker check a signed request
  before decoding it; the lease tells a running handler whether its hold still stands.
]]
local row = redis.call('HMGET', KEYS[1], 'status', 'env', 'agent', 'attempt', 'created', 'deadline', 'id',
  'from', 'to', 'routed', 'caps', 'sig', 'lease')
local t = redis.call('TIME')
row[14] = row[13]
row[13] = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if row[1] then row[2] = redis.call('GET', KEYS[2]) or row[2] end  -- or a pre-split record's own field
return row
