--[[
  Shared helpers for scripts in a capability set's routing slot. Every route script receives:

    KEYS[1] route queue   <p>:{~r:<set id>}:route    (zset handoff id -> aged score, see route-4.lua)
    KEYS[2] route meta    <p>:{~r:<set id>}:rmeta    (hash handoff id -> "score|deadline|refused|deferred")
    KEYS[3] claims        <p>:{~r:<set id>}:rclaims  (zset handoff id -> claim expiry ms)
    KEYS[4] sequence      <p>:{~r:<set id>}:rseq     (routing clock: the last tick issued, in
                                                      1/1024 ms; FIFO order within a priority)

  refused is ",a,b," (agents that refused it: never offered to them again); deferred is
  ",a=<until ms>," (agents that asked to be retried after a time).
]]

local function route_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- A refused (",a,b,") or deferred (",a=<ms>,") list as given, if it holds only agent ids and
-- their separators; else the empty list ","
local function agent_list(value)
  if string.find(value, '^[%w_.:,=-]*$') then return value end
  return ','
end

-- {score, deadline, refused, deferred} of a meta value (all nil if it cannot be read)
local function parse_meta(value)
  local score, deadline, refused, deferred = string.match(value, '^([^|]*)|([^|]*)|([^|]*)|([^|]*)$')
  return tonumber(score), tonumber(deadline), refused, deferred
end

-- refused and deferred lists as a route call brings them, merged with the ones already in the
-- meta: a route call computed from an older record (the sweep's, racing a refusal) must not
-- drop a refusal the queue already knows of. Refusals are kept; a deferral keeps its later time.
local function merge_meta(refused, deferred, old_refused, old_deferred)
  for agent in string.gmatch(old_refused, '[^,]+') do
    if not string.find(refused, ',' .. agent .. ',', 1, true) then refused = refused .. agent .. ',' end
  end
  for agent, untils in string.gmatch(old_deferred, '([^,=]+)=(%d+)') do
    local now_until = deferred_until(deferred, agent)  -- offer.lua, included first
    if not now_until then
      deferred = deferred .. agent .. '=' .. untils .. ','
    elseif tonumber(untils) > now_until then
      deferred = string.gsub(deferred, ',' .. string.gsub(agent, '%p', '%%%0') .. '=%d+,', ',' .. agent .. '=' .. untils .. ',')
    end
  end
  return refused, deferred
end
