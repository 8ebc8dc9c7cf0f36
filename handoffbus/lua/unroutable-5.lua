--[[
  unroutable: a capability-routed handoff no capable agent is left to take ends REJECTED,
  decided by the router: code NO_CAPABLE_AGENT, and the agents that refused it in rmeta.

  KEYS[1] record hash   KEYS[2] pending marker   KEYS[3] deadline index   KEYS[4] response stream
  KEYS[5] request envelope
  ARGV[1] handoff id    ARGV[2] request id
  ARGV[3] record retention ms   ARGV[4] response stream retention ms
  ARGV[5] reason   ARGV[6] rmeta (encoded {"refused": [...]})

  Returns {1, '', status, actor, updated, agent, reason, code, retry, redirect, result, error,
  rmeta, sig} (actor "_router"); {0} when it is
  offered to an agent meanwhile (left alone); {-1} not found; {-2, status} not PENDING;
  {-3} expired (made EXPIRED now); {-4} not a routed handoff.
]]
-- @flags allow-oom
-- @include record

local request_id = ARGV[2]
local retention_ms, response_retention_ms = tonumber(ARGV[3]), tonumber(ARGV[4])
local rec = read_record(KEYS[1], {'routed', 'to'})
if not rec.status then return {-1} end
local now = now_ms()
if expire_if_due(KEYS, rec, request_id, now, retention_ms, response_retention_ms) then return {-3, ''} end
if rec.status ~= 'PENDING' then return {-2, rec.status} end
if rec.routed ~= '1' then return {-4} end
if rec.to ~= '' then return {0} end
local ts, values = transition(KEYS, rec, request_id, 'REJECTED', '_router', now,
  {'reason', ARGV[5], 'code', 'NO_CAPABLE_AGENT', 'rmeta', ARGV[6]}, retention_ms, response_retention_ms)
return response_reply('REJECTED', '_router', ts, values, {1, ''})
