--[[
  reject: the target agent refuses a PENDING handoff; REJECTED is terminal. A capability-routed
  handoff refused by the agent it is offered to is not rejected: the refusal is recorded and
  the handoff goes on to the next capable agent (the caller routes it again).

  KEYS[1] record hash   KEYS[2] pending marker   KEYS[3] deadline index   KEYS[4] response stream
  KEYS[5] request envelope
  ARGV[1] handoff id    ARGV[2] request id       ARGV[3] acting agent
  ARGV[4] record retention ms     ARGV[5] response stream retention ms
  ARGV[6..] response field/value pairs (reason, code, retry, redirect, rmeta), and 'guard' =
            routing guard ms for a routed handoff (see request-6.lua)

  Allowed from: PENDING.   Who: the to_agent (for a routed handoff: the agent it is offered to).
  Returns:
    {1, to agent, ts, owner}  transition made; the response was appended to KEYS[4]: this status
       and actor, ts, the owner (the accepting agent, if any) and the response fields of ARGV[6..]
    {0, to agent, status, actor, updated, agent, reason, code, retry, redirect, result, error, rmeta, sig}
       this actor already made this transition: nothing written or emitted
    {2, to agent, handoff id, capability set, priority, created, deadline, refused, deferred, redirect}
       a routed handoff refused: it is PENDING with no agent; route it again (nothing emitted).
       With a retry time the agent is deferred until then rather than marked as refusing.
    {-1} no such handoff   {-2, current status, owner} invalid transition (owner: the agent that accepted it, if
       that is the acting agent or the requester; else false)
    {-3, to agent} the acceptance deadline passed (the record is now EXPIRED and EXPIRED was emitted)
    {-3, false} it was EXPIRED already (nothing written or emitted)
    {-4} the acting agent may not make this transition
    {-9, field} ARGV[6..] names a field a transition may not write
  Events: one entry on KEYS[4]: id, status, actor, ts and the response fields (not for a refusal).
]]
-- @flags allow-oom
-- @include record
-- @include offerback

local rec = redis.call('HMGET', KEYS[1], 'routed', 'status', 'to', 'chain', 'refused', 'deferred')
local actor = ARGV[3]
if rec[1] ~= '1' or rec[2] ~= 'PENDING' or rec[3] ~= actor or redis.call('EXISTS', KEYS[2]) == 0 then
  return run_transition('REJECTED', {PENDING = true}, 'target')
end

local fields = {}
for i = 6, #ARGV, 2 do fields[ARGV[i]] = ARGV[i + 1] end
local now = now_ms()
local refused, deferred = rec[5], rec[6]
local event = 'REFUSED'
-- defer this agent again, or drop its deferral and mark it as refusing
if fields.retry then
  -- the client checks it (checks.MAX_RETRY_MS); bounded here too, as past 2^63 '%d' would
  -- store a negative time no reader parses (the agent would be offered it again at once)
  local retry = tonumber(fields.retry) or 0
  if retry ~= retry or retry < 0 then retry = 0 elseif retry > 315360000000 then retry = 315360000000 end
  deferred = defer(deferred, actor, now + retry)
  event = 'DEFERRED'
else
  deferred = defer(deferred, actor, nil)
  refused = refused .. actor .. ','
end
return offer_back(KEYS, ARGV[2], rec[4], actor, event, now, fields.code, tonumber(fields.guard) or 5000,
  {'refused', refused, 'deferred', deferred}, fields.redirect)
