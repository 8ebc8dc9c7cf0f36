--[[
  Whether an agent may be offered a capability-routed handoff, by its refused and deferred
  lists (as the record and the route meta hold them). Pasted where a script says
  "-- @include offer": by pull, in the set's slot, and by assign, on the record.

  refused is ",a,b," (agents that refused it: never offered to them again); deferred is
  ",a=<until ms>," (agents that asked to be retried after a time, or whose offer lapsed).
]]

-- true if `agent` may be offered the handoff now
local function eligible(agent, refused, deferred, now)
  if string.find(refused or ',', ',' .. agent .. ',', 1, true) then return false end
  local at = string.find(deferred or ',', ',' .. agent .. '=', 1, true)
  if at then
    local untils = string.match(deferred, '^(%d+)', at + #agent + 2)
    if untils and tonumber(untils) > now then return false end
  end
  return true
end
