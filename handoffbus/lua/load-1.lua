--[[
  load: read what a worker needs to decide on a handoff it took, or a pending listing shows
  (read only). A script so
  that it travels in the same pipelines as the transitions.

  KEYS[1] record hash   <p>:{R}:h:<request_id>

  Returns {status, encoded request, owning agent, attempt, created ms, deadline ms}; all false
  (nil) when the record is gone.
]]
return redis.call('HMGET', KEYS[1], 'status', 'env', 'agent', 'attempt', 'created', 'deadline')
