--[[
  sweep: expire every PENDING handoff of one requester whose deadline has passed, and take
  back the lapsed offers of capability-routed ones, in a batch. Run by whichever bus holds
  the sweep lease; the scripts' own expiry checks keep every other path exact, so the sweep
  only decides how soon an idle requester hears EXPIRED, and how soon a routed handoff whose
  chosen agent died (or whose requester died before routing it) is routed again.

  KEYS[1] deadline index  <p>:{R}:deadlines  (request id -> deadline; "o:" .. request id ->
          when the routed handoff's current offer, or routing guard, lapses; "~s:" .. request id
          -> when to settle an EXPIRED handoff's target queue again: set by its expiry, removed
          by the caller once settled)
  ARGV[1] key prefix of R's slot, e.g. "hb:{agent-1}:" (records, markers and envelopes are built from it;
          they share KEYS[1]'s hash tag, so the script stays in one slot)
  ARGV[2] batch size      ARGV[3] record retention ms      ARGV[4] response stream retention ms
  ARGV[5] ms for which an agent whose offer lapsed is passed over (others are offered first)
  ARGV[6] routing guard ms: a lapsed offer's "o:" entry is set that far ahead, not removed, so
          that if the caller's routing of it is lost (its reply, or the caller itself) the
          sweep routes it once more then (as `reject` guards a refusal)

  Returns {expired count, lapsed count, (handoff id, to agent, capability set) per expired
  handoff, then per lapsed offer: handoff id, capability set, priority, created, deadline,
  refused, deferred, may end ('0' for the guard of a handoff its agent released: a release is
  never final, see release-5.lua; else '1'), the agent whose offer lapsed ('' for a guard),
  then per due "~s:" entry: handoff id, to agent}. The "~s:" entries of handoffs expired here
  and of those reported are the caller's to remove (ZREM) once it settled their queues; a
  reported one is due again after ARGV[6] ms, so one whose settling keeps failing holds up
  no batch. Their queues are settled again, not counted again.
  The capability set is '' for a direct handoff. The caller removes expired
  handoffs from their target queues (to agent), and from their set's route queue (capability
  set: one not offered to an agent waits there), and routes lapsed ones again (and takes a
  lapsed one out of the inbox of its agent, if no live worker holds it there).
  Events: EXPIRED on <p>:{R}:responses for each expired handoff.
]]
-- @flags allow-oom
-- @include record

local base = ARGV[1]
-- the requester, from its slot's key prefix: a record's id must be its own ("<R>/<request id>"),
-- for the caller settles and routes again by the ids this returns (a record written by hand,
-- or by an agent's own user, must not make it touch another agent's handoffs)
local requester = string.match(base, '{(.*)}:$')
local retention_ms, response_retention_ms = tonumber(ARGV[3]), tonumber(ARGV[4])
local now = now_ms()
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', fmt(now), 'LIMIT', 0, tonumber(ARGV[2]))
local out, lapsed, resettle = {0, 0}, {}, {}
for _, member in ipairs(due) do
  local offer = string.sub(member, 1, 2) == 'o:'
  if string.sub(member, 1, 3) == '~s:' then
    local request_id = string.sub(member, 4)
    local rec = read_record(base .. 'h:' .. request_id, {'to'})
    if rec.status == 'EXPIRED' and rec.id == requester .. '/' .. request_id and (rec.to or '') ~= '' then
      resettle[#resettle + 1] = rec.id
      resettle[#resettle + 1] = rec.to
      redis.call('ZADD', KEYS[1], fmt(now + tonumber(ARGV[6] or 0)), member)
    else
      redis.call('ZREM', KEYS[1], member)  -- gone, or not its own: nothing to settle from here
    end
  else
    local request_id = offer and string.sub(member, 3) or member
    local keys = {base .. 'h:' .. request_id, base .. 'p:' .. request_id, KEYS[1], base .. 'responses',
      base .. 'e:' .. request_id}
    local rec = read_record(keys[1], {'to', 'chain', 'deferred', 'caps'})
    if rec.status ~= 'PENDING' or rec.id ~= requester .. '/' .. request_id then
      redis.call('ZREM', KEYS[1], member)  -- decided, gone or not its own: a stale index entry
    elseif expire_if_due(keys, rec, request_id, now, retention_ms, response_retention_ms) then
      out[1] = out[1] + 1
      out[#out + 1] = rec.id
      out[#out + 1] = rec.to or ''
      out[#out + 1] = rec.caps or ''
    elseif offer then
      if rec.to ~= '' then
        -- it did not refuse, but it did not decide either: offer others first for a while
        chain_add(keys[1], rec.chain, rec.to, 'LAPSED', now, nil)
        redis.call('HSET', keys[1], 'to', '', 'deferred', defer(rec.deferred, rec.to, now + tonumber(ARGV[5] or 0)))
        redis.call('ZADD', KEYS[1], now + tonumber(ARGV[6] or 0), member)  -- the guard (assign replaces it)
      else
        redis.call('ZREM', KEYS[1], member)  -- a guard: routed again now, once
      end
      local info = route_info(keys[1])
      for i = 1, #info do lapsed[#lapsed + 1] = info[i] end
      -- the guard of a release, the last step of its route (chain_add: [agent, event, ts, code])
      local released = rec.to == '' and string.find(rec.chain or '', ',"RELEASED",%d+,""%]%]$') ~= nil
      lapsed[#lapsed + 1] = released and '0' or '1'
      lapsed[#lapsed + 1] = rec.to or ''
      out[2] = out[2] + 1
    end
    -- else the marker outlives TIME by under a millisecond: the next pass takes it
  end
end
for i = 1, #lapsed do out[#out + 1] = lapsed[i] end
for i = 1, #resettle do out[#out + 1] = resettle[i] end
return out
