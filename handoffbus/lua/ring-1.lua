--[[
  ring: wake an agent's idle workers (blocked on its doorbell) to pull routed work.

  KEYS[1] doorbell   <p>:{T}:bell   (stream, MAXLEN 1)
  ARGV[1] handoff id (for operators watching the bell)

  Returns the doorbell entry id.
]]
-- @flags allow-oom
return redis.call('XADD', KEYS[1], 'MAXLEN', 1, '*', 'h', ARGV[1])
