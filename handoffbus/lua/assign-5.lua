--[[
  assign: offer a PENDING capability-routed handoff to one agent. Only that agent may accept
  or refuse it while the offer stands; an offer not decided within the offer time lapses and
  the expiry sweep routes the handoff again (the agent may have died after it was chosen).

  KEYS[1] record hash   KEYS[2] pending marker   KEYS[3] deadline index   KEYS[4] response stream
  KEYS[5] request envelope
  ARGV[1] handoff id    ARGV[2] request id       ARGV[3] agent
  ARGV[4] offer time ms   ARGV[5] record retention ms   ARGV[6] response stream retention ms
  ARGV[7] when the agent was chosen (server ms, from `pull`; 0 = now): the OFFERED step's time,
          so that the route shows the order in which a set's queue gave its handoffs out (one
          before the request was made, or after now, is now)

  Returns:
    {1} offered to the agent now (or again: the same agent renews its offer)
    {0, agent} it is offered to another agent, whose offer still stands
    {2, agent, handoff id, capability set, priority, created, deadline, refused, deferred}
       the agent refused it, or is deferred: the queue it was pulled from knew less than the
       record (a route call raced the refusal). Nothing written; route it again with these.
    {-1} no such handoff   {-2, status} not PENDING   {-3} its deadline passed (made EXPIRED now)
    {-4} not a routed handoff
]]
-- @flags allow-oom
-- @include record
-- @include offer

local request_id, agent = ARGV[2], ARGV[3]
local rec = read_record(KEYS[1], {'routed', 'to', 'chain', 'refused', 'deferred', 'created'})
if not rec.status then return {-1} end
local now = now_ms()
if expire_if_due(KEYS, rec, request_id, now, tonumber(ARGV[5]), tonumber(ARGV[6])) then return {-3} end
if rec.status ~= 'PENDING' then return {-2, rec.status} end
if rec.routed ~= '1' then return {-4} end
local chain = rec.chain
if rec.to ~= '' and rec.to ~= agent then
  local offer = redis.call('ZSCORE', KEYS[3], 'o:' .. request_id)
  if offer and tonumber(offer) > now then return {0, rec.to} end
end
if rec.to ~= agent and not eligible(agent, rec.refused, rec.deferred, now) then
  local info = route_info(KEYS[1])
  return {2, agent, info[1], info[2], info[3], info[4], info[5], info[6], info[7]}
end
if rec.to ~= '' and rec.to ~= agent then chain = chain_add(KEYS[1], chain, rec.to, 'LAPSED', now, nil) end
redis.call('HSET', KEYS[1], 'to', agent)
local chosen = tonumber(ARGV[7])
-- never before the request, nor after now (nor NaN): the caller's word, an isolated agent's too
if not chosen or chosen ~= chosen or chosen < (tonumber(rec.created) or 0) or chosen > now then chosen = now end
if rec.to ~= agent then chain_add(KEYS[1], chain, agent, 'OFFERED', chosen, nil) end
redis.call('ZADD', KEYS[3], now + tonumber(ARGV[4]), 'o:' .. request_id)
return {1}
