--[[
  Shared helpers for scripts in a capability set's routing slot. Every route script receives:

    KEYS[1] route queue   <p>:{~r:<set id>}:route    (zset handoff id -> aged score, see route-4.lua)
    KEYS[2] route meta    <p>:{~r:<set id>}:rmeta    (hash handoff id -> "score|deadline|refused|deferred")
    KEYS[3] claims        <p>:{~r:<set id>}:rclaims  (zset handoff id -> claim expiry ms)
    KEYS[4] sequence      <p>:{~r:<set id>}:rseq     (counter: FIFO order within one millisecond)

  refused is ",a,b," (agents that refused it: never offered to them again); deferred is
  ",a=<until ms>," (agents that asked to be retried after a time).
]]

local function route_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- {score, deadline, refused, deferred} of a meta value
local function parse_meta(value)
  local score, deadline, refused, deferred = string.match(value, '^([^|]*)|([^|]*)|([^|]*)|([^|]*)$')
  return tonumber(score), tonumber(deadline), refused, deferred
end

-- true if `agent` may be offered the handoff now
local function eligible(agent, refused, deferred, now)
  if string.find(refused, ',' .. agent .. ',', 1, true) then return false end
  local at = string.find(deferred, ',' .. agent .. '=', 1, true)
  if at then
    local untils = string.match(deferred, '^(%d+)', at + #agent + 2)
    if untils and tonumber(untils) > now then return false end
  end
  return true
end
