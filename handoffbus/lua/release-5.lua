--[[
  release: a worker that took a capability-routed handoff offered to its agent, and stopped
  before deciding it, gives the offer up: the handoff is PENDING with no agent, to be routed
  again by the caller at once (rather than wait in the agent's own queue until the offer
  lapses). The agent is neither marked as refusing nor deferred: its other workers may pull
  it again.

  KEYS[1] record hash   KEYS[2] pending marker   KEYS[3] deadline index   KEYS[4] response stream
  KEYS[5] request envelope
  ARGV[1] handoff id    ARGV[2] request id       ARGV[3] acting agent
  ARGV[4] record retention ms     ARGV[5] response stream retention ms (unused: the layout
          of a transition's, so that the forwarder checks and pins it as one)
  ARGV[6] routing guard ms (see request-6.lua)

  The caller settles the handoff's inbox entry first (requeue-5.lua, settling only), and only
  if its consumer still holds it: a handoff another worker of the agent claimed is left to it.

  Returns:
    {2, agent, handoff id, capability set, priority, created, deadline, refused, deferred, false}
       released: route it again with these (the shape of reject's routed refusal)
    {0} left alone: not a routed handoff offered to this agent, not PENDING, past its deadline
        or gone (nothing written)
  Events: none (the requester hears nothing; the route shows RELEASED).
]]
-- @flags allow-oom
-- @include record
-- @include offerback

local rec = redis.call('HMGET', KEYS[1], 'routed', 'status', 'to', 'chain')
local agent, guard = ARGV[3], tonumber(ARGV[6]) or 5000
if rec[1] ~= '1' or rec[2] ~= 'PENDING' or rec[3] ~= agent or redis.call('EXISTS', KEYS[2]) == 0 then
  return {0}
end
-- the offer's entry becomes a routing guard: the sweep routes it if the caller does not
return offer_back(KEYS, ARGV[2], rec[4], agent, 'RELEASED', now_ms(), nil, guard, {}, false)
