--[[
  Shared helpers for scripts in the requester's slot. The loader pastes this file where a
  script says "-- @include record". Every record script receives the same five keys:

    KEYS[1] record hash      <p>:{R}:h:<request_id>
    KEYS[2] pending marker   <p>:{R}:p:<request_id>  (string, PXAT = acceptance deadline)
    KEYS[3] deadline index   <p>:{R}:deadlines       (zset request_id -> deadline ms; "o:" and
                             "~s:" entries: see sweep-1.lua)
    KEYS[4] response stream  <p>:{R}:responses
    KEYS[5] request envelope <p>:{R}:e:<request_id>  (string: the encoded request)

  The envelope lives apart from the record so that the record's small fields stay a
  listpack (a value over hash-max-listpack-value, 64 bytes by default, would turn the whole
  hash into a hashtable, about 600 bytes more per handoff). Records written before the
  split keep an `env` field; readers fall back to it.

  A PENDING handoff whose marker has expired is past its deadline. Redis judges key
  expiry inside a script against the script's start time, so "accept" and "expire"
  racing in the same millisecond have exactly one winner.
]]

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- an integral number (ms) as text: '%d' (a C long) formats it without the floating-point
-- conversion '%.0f' or tostring() costs; every value given is a whole number of ms below 2^53
local function fmt(n)
  return string.format('%d', n)
end

-- The fields one transition's response carries that the next must not keep; with the owner,
-- 'agent', which stays, all a response carries besides id/status/actor/ts (read back by the
-- client). What a transition's caller may pass in ARGV[6..] (see run_transition): those, its
-- lease and a refusal's routing guard. (The library's top level runs once, at its load, where
-- no global function may be called: a plain loop builds the sets.)
local CLEARED = {'reason', 'code', 'retry', 'redirect', 'result', 'error', 'rmeta', 'sig'}
local RESPONSE_FIELDS, IS_CLEARED, WRITABLE = {'agent'}, {}, {lease = true, guard = true}
for i = 1, #CLEARED do
  RESPONSE_FIELDS[i + 1], IS_CLEARED[CLEARED[i]], WRITABLE[CLEARED[i]] = CLEARED[i], true, true
end
local TERMINAL = {REJECTED = true, COMPLETED = true, EXPIRED = true, CANCELLED = true, FAILED = true}

-- A response as the flat reply the client reads: status, actor, ts, then RESPONSE_FIELDS
-- (false where absent). `values` maps field name -> value.
local function response_reply(status, actor, ts, values, head)
  local out = head or {}
  local n = #out
  out[n + 1], out[n + 2], out[n + 3] = status, actor, ts
  for i = 1, #RESPONSE_FIELDS do out[n + 3 + i] = values[RESPONSE_FIELDS[i]] or false end
  return out
end

-- The record's stored response (for a repeated transition).
local function stored_response(key)
  return redis.call('HMGET', key, 'status', 'actor', 'updated', unpack(RESPONSE_FIELDS))
end

--[[
  Move a record to `status`: write `extra` (field/value pairs), append the history entry
  (status, actor, Redis time), leave the pending indexes when leaving PENDING, emit the
  response, and start the retention TTL once terminal. `rec` holds what the caller read:
  status, id, hist (a missing or malformed one starts anew), agent (the owner, if any) and,
  if read, rf. Names in history are validated by the client to [A-Za-z0-9_.:-]. Returns the
  transition's ts (text) and the response's values (field name -> value), for response_reply().
]]
local function transition(keys, rec, request_id, status, actor, now, extra, retention_ms, response_retention_ms)
  local key, ts = keys[1], fmt(now)
  -- a response carries its own transition's fields only. `rf` holds the status a transition
  -- (or the request) left when it wrote none of them: nothing to clear then. Any other
  -- writer of those fields, an older version's transition included, changes the status and
  -- not rf; a record without rf is cleared.
  if rec.rf ~= rec.status then redis.call('HDEL', key, unpack(CLEARED)) end
  -- a record without a history (written by hand, or cut short) gets one, rather than the
  -- script failing on it for good (the sweep would try it again every pass)
  local item, hist = '["' .. status .. '","' .. actor .. '",' .. ts .. ']', rec.hist or '[]'
  if string.sub(hist, 1, 1) ~= '[' or string.sub(hist, -1) ~= ']' then hist = '[]' end
  hist = (hist == '[]') and ('[' .. item .. ']') or (string.sub(hist, 1, -2) .. ',' .. item .. ']')
  local fields = {'status', status, 'actor', actor, 'updated', ts, 'hist', hist}
  local values = {agent = rec.agent}
  local clean = status
  for i = 1, #extra, 2 do
    fields[#fields + 1] = extra[i]
    fields[#fields + 1] = extra[i + 1]
    values[extra[i]] = extra[i + 1]
    if IS_CLEARED[extra[i]] then clean = '' end
  end
  fields[#fields + 1] = 'rf'
  fields[#fields + 1] = clean
  redis.call('HSET', key, unpack(fields))
  if rec.status == 'PENDING' then
    redis.call('DEL', keys[2])
    redis.call('ZREM', keys[3], request_id, 'o:' .. request_id)
    if status == 'EXPIRED' and (redis.call('HGET', key, 'to') or '') ~= '' then
      -- its target's queue is settled by the caller, in another slot: should that be lost (a
      -- reply, the caller), the sweep settles it again from this entry (see sweep-1.lua)
      redis.call('ZADD', keys[3], ts, '~s:' .. request_id)
    end
  end
  local entry = {'id', rec.id, 'status', status, 'actor', actor, 'ts', ts}
  for i = 1, #RESPONSE_FIELDS do
    local value = values[RESPONSE_FIELDS[i]]
    if value then
      entry[#entry + 1] = RESPONSE_FIELDS[i]
      entry[#entry + 1] = value
    end
  end
  redis.call('XADD', keys[4], 'MINID', '~', fmt(now - response_retention_ms), '*', unpack(entry))
  if TERMINAL[status] then
    redis.call('PEXPIRE', key, retention_ms)
    redis.call('PEXPIRE', keys[5], retention_ms)
  end
  return ts, values
end

-- Read what transition() needs, as a table: status, id, hist, agent, plus `more` fields.
local function read_record(key, more)
  local values = redis.call('HMGET', key, 'status', 'id', 'hist', 'agent', unpack(more))
  local rec = {status = values[1] or nil, id = values[2] or nil, hist = values[3] or nil, agent = values[4] or nil}
  for i = 1, #more do rec[more[i]] = values[i + 4] or nil end
  return rec
end

-- If the record is PENDING and its marker has expired, make it EXPIRED now. Returns true if so.
local function expire_if_due(keys, rec, request_id, now, retention_ms, response_retention_ms)
  if rec.status == 'PENDING' and redis.call('EXISTS', keys[2]) == 0 then
    transition(keys, rec, request_id, 'EXPIRED', 'bus', now, {}, retention_ms, response_retention_ms)
    rec.status = 'EXPIRED'
    return true
  end
  return false
end

local function last_response_id(stream)
  local last = redis.call('XREVRANGE', stream, '+', '-', 'COUNT', 1)
  if last[1] then return last[1][1] end
  return '0-0'
end

--[[
  The body shared by accept, reject, complete, fail and cancel.
    ARGV[1] handoff id   ARGV[2] request id   ARGV[3] acting agent
    ARGV[4] record retention ms after a terminal status
    ARGV[5] response stream retention ms
    ARGV[6..] field/value pairs to store and send (reason, code, retry, redirect, result, error, rmeta)
  Checks, in order: exists; expired (made EXPIRED now if due); the same actor (with the same
  lease) repeating this transition; the current status is one the transition may leave; the
  actor's right; for complete and fail, the lease (field 'lease' in ARGV[6..]) against the
  record's.
  `from` lists the statuses the transition may leave; `who` names who may make it:
  'target' (the to_agent, or anyone while to_agent is empty), 'owner' (the accepting agent),
  'requester' (the from_agent).
  Returns {1, to agent, ts, owner} done now (the response is the caller's own fields, with
  this status, actor, ts and owner: no need to send them back), {0, to agent, <response>} the same
  actor already did it (nothing emitted), or {-1} not found, {-2, status, owner} invalid transition (owner: the accepting agent, told only to itself and the requester), {-3, to agent} made EXPIRED now ({-3, false}: it
  was already), {-4} not permitted,
  {-6, holder} the lease is held by another consumer, {-9, field} a field it may not write.
]]
local function run_transition(status, from, who)
  local request_id, actor = ARGV[2], ARGV[3]
  local retention_ms, response_retention_ms = tonumber(ARGV[4]), tonumber(ARGV[5])
  -- the fields a transition may write: any other name (status, id, to, fp, hist...) would let
  -- an agent rewrite the record, or send a response in another handoff's name
  local extra, lease, rmeta = {}, '', nil
  for i = 6, #ARGV, 2 do
    local name = ARGV[i]
    if not WRITABLE[name] then return {-9, name} end
    if name == 'lease' then lease = ARGV[i + 1] end
    if name == 'rmeta' then rmeta = ARGV[i + 1] end
    if name ~= 'guard' then  -- a refusal's routing guard is for routing it on (reject-5), not the record
      extra[#extra + 1] = name
      extra[#extra + 1] = ARGV[i + 1]
    end
  end
  local rec = read_record(KEYS[1], {'from', 'to', 'actor', 'lease', 'routed', 'rf'})
  local current = rec.status
  if not current then return {-1} end
  local to = rec.to
  local now = now_ms()
  if expire_if_due(KEYS, rec, request_id, now, retention_ms, response_retention_ms) then
    return {-3, to}
  end

  if current == status and rec.actor == actor and (rec.lease or '') == lease then
    return {0, to, unpack(stored_response(KEYS[1]))}
  end
  -- the status decides first: anything on a terminal handoff is an invalid transition
  if not from[current] then
    if current == 'EXPIRED' then return {-3, false} end  -- expired before: settled and counted then
    -- who accepted it, told to that agent and to the requester only (another agent's attempt
    -- must not learn where a handoff went)
    local owner = (rec.agent and (rec.agent == actor or rec.from == actor)) and rec.agent or false
    return {-2, current, owner}
  end
  local allowed
  if who == 'target' then
    -- a routed handoff is decided only by the agent it is offered to right now
    allowed = (to == actor) or (to == '' and rec.routed ~= '1')
  elseif who == 'owner' then
    allowed = (rec.agent == actor)
  else
    allowed = (rec.from == actor)
  end
  if not allowed then return {-4} end
  -- a handoff accepted under a lease is finished only by the lease's holder (a worker that
  -- was stopped while its work was reclaimed cannot write an outcome)
  if who == 'owner' and (rec.lease or '') ~= lease then return {-6, rec.lease or ''} end

  if status == 'ACCEPTED' then
    extra[#extra + 1] = 'agent'
    extra[#extra + 1] = actor
    extra[#extra + 1] = 'attempt'
    extra[#extra + 1] = '1'
    if rmeta then  -- kept past the next transitions: a handle attached later hears the decision whole
      extra[#extra + 1] = 'ameta'
      extra[#extra + 1] = rmeta
    end
  end
  local ts, values = transition(KEYS, rec, request_id, status, actor, now, extra, retention_ms, response_retention_ms)
  return {1, to, ts, values.agent or false}
end

-- Append [agent, event, ts, code] to a routed record's chain (JSON text, like hist).
local function chain_add(key, chain, agent, event, now, code)
  local item = '["' .. agent .. '","' .. event .. '",' .. fmt(now) .. ',"' .. (code or '') .. '"]'
  if chain == '[]' or not chain then chain = '[' .. item .. ']'
  else chain = string.sub(chain, 1, -2) .. ',' .. item .. ']' end
  redis.call('HSET', key, 'chain', chain)
  return chain
end

-- A routed record's deferrals (",a=<until ms>,") without `agent`'s, then with it until `untils`
-- when given.
local function defer(deferred, agent, untils)
  deferred = string.gsub(deferred or ',', ',' .. string.gsub(agent, '%p', '%%%0') .. '=%d+,', ',')
  if untils then deferred = deferred .. agent .. '=' .. fmt(untils) .. ',' end
  return deferred
end

-- What a caller needs to route a handoff again (after a refusal or a lapsed offer):
-- {handoff id, capability set, priority, created ms, deadline ms, refused, deferred}
local function route_info(key)
  return redis.call('HMGET', key, 'id', 'caps', 'prio', 'created', 'deadline', 'refused', 'deferred')
end
