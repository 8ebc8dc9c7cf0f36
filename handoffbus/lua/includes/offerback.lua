--[[
  Pasted after "record" where a script says "-- @include offerback": by reject (a routed
  handoff refused or deferred) and release (one its stopping worker gave back), the two ways
  an agent gives an offer back.
]]

-- Take a routed handoff's offer back from `agent` (a refusal, a deferral, a release): PENDING
-- with no agent, `event` in its route, and a routing guard `guard_ms` ahead, so that the sweep
-- routes it should the caller not; `fields`: more field/value pairs to write. Returns what the
-- caller routes it again with: {2, agent, <route_info>, redirect}.
local function offer_back(keys, request_id, chain, agent, event, now, code, guard_ms, fields, redirect)
  redis.call('HSET', keys[1], 'to', '', 'updated', fmt(now), unpack(fields))
  chain_add(keys[1], chain, agent, event, now, code)
  redis.call('ZADD', keys[3], now + guard_ms, 'o:' .. request_id)
  local info = route_info(keys[1])
  return {2, agent, info[1], info[2], info[3], info[4], info[5], info[6], info[7], redirect or false}
end
