--[[
  cancel: the requester withdraws a PENDING handoff; CANCELLED is terminal.

  KEYS[1] record hash   KEYS[2] pending marker   KEYS[3] deadline index   KEYS[4] response stream
  KEYS[5] request envelope
  ARGV[1] handoff id    ARGV[2] request id       ARGV[3] acting agent
  ARGV[4] record retention ms     ARGV[5] response stream retention ms
  ARGV[6..] response field/value pairs (reason, rmeta)

  Allowed from: PENDING.   Who: the from_agent.
  Returns:
    {1, to agent, ts, owner}  transition made; the response was appended to KEYS[4]: this status
       and actor, ts, the owner (the accepting agent, if any) and the response fields of ARGV[6..]
    {0, to agent, status, actor, updated, agent, reason, code, retry, redirect, result, error, rmeta, sig}
       this actor already made this transition: nothing written or emitted
    {-1} no such handoff   {-2, current status, owner} invalid transition (owner: the agent that accepted it, if
       that is the acting agent or the requester; else false)
    {-3, to agent} the acceptance deadline passed (the record is now EXPIRED and EXPIRED was emitted)
    {-3, false} it was EXPIRED already (nothing written or emitted)
    {-4} the acting agent may not make this transition
    {-9, field} ARGV[6..] names a field a transition may not write
  Events: one entry on KEYS[4]: id, status, actor, ts and the response fields.
]]
-- @flags allow-oom
-- @include record
return run_transition('CANCELLED', {PENDING = true}, 'requester')
