--[[
  Whether an agent may be offered a capability-routed handoff, by its refused and deferred
  lists (as the record and the route meta hold them). Pasted where a script says
  "-- @include offer": by pull and route, in the set's slot (before "route"), and by assign,
  on the record.

  refused is ",a,b," (agents that refused it: never offered to them again); deferred is
  ",a=<until ms>," (agents that asked to be retried after a time, or whose offer lapsed).
]]

-- the time (ms) until which `agent` is deferred, or nil
local function deferred_until(deferred, agent)
  local at = string.find(deferred or ',', ',' .. agent .. '=', 1, true)
  return at and tonumber(string.match(deferred, '^(%d+)', at + #agent + 2)) or nil
end

-- true if `agent` may be offered the handoff now
local function eligible(agent, refused, deferred, now)
  if string.find(refused or ',', ',' .. agent .. ',', 1, true) then return false end
  local untils = deferred_until(deferred, agent)
  return not (untils and untils > now)
end
