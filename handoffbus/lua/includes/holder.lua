--[[
  Who holds an inbox entry. Pasted where a script says "-- @include holder": by the queue
  scripts (before "queue", which uses RESTORED) and by deadletter.
]]

-- Consumer holding restored entries until their live handler adopts them or, its worker
-- being gone, a live worker claims them once idle.
local RESTORED = '_restored'

-- Whether a consumer other than `consumer` holds `entry` of `inbox` (a restored entry not yet
-- adopted counts as anyone's): one that claimed it while `consumer` was slow, and works under
-- it now. No group or no stream (deleted under running workers): no one holds anything.
local function held_elsewhere(inbox, group, entry, consumer)
  local ok, pending = pcall(redis.call, 'XPENDING', inbox, group, entry, entry, 1)
  local held = ok and pending[1]
  return held and held[2] ~= consumer and held[2] ~= RESTORED or false
end
