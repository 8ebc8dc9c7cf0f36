--[[
  request: create a PENDING handoff record in the requester's slot, or report the one that
  already exists for this request id (idempotent resubmission).

  KEYS[1] record hash   KEYS[2] pending marker   KEYS[3] deadline index   KEYS[4] response stream
  KEYS[5] request envelope
  KEYS[6] the staged envelope <p>:{R}:s:<request_id>:<nonce>, read with ARGV[15] only (a
          caller that passes the envelope in ARGV[6] may leave it out)
  ARGV[1] handoff id    ARGV[2] request id        ARGV[3] from agent    ARGV[4] to agent ('' = routed)
  ARGV[5] acceptance timeout ms                   ARGV[6] encoded request envelope (stored in KEYS[5])
  ARGV[7] record retention ms                     ARGV[8] response stream retention ms
  ARGV[9] request fingerprint (digest of the canonical request: same content, same digest,
          whatever the codec, compression or dict key order)
  ARGV[10] capability set (sorted, comma-separated)   ARGV[11] priority
  ARGV[12] routing guard ms: a routed handoff not assigned to an agent by then is routed
           again by the expiry sweep (covers a requester that died before routing it)
  ARGV[13] cap on the requester's undecided handoffs, counted as KEYS[3] entries (one per
           undecided handoff, a routed one has a second while it waits on an offer or a routing
           guard); 0 = none
  ARGV[14] signature ('' = unsigned), stored as the record's `rsig` (see signing.py); `sig`
           holds the last transition's response signature
  ARGV[15] '1' = the envelope is staged at KEYS[6] instead of passed in ARGV[6]: a large one,
           written by a plain SET just before (a large value costs Redis far more passing
           through Lua). It is renamed into KEYS[5] if the record is created, deleted otherwise.

  Returns:
    {1, 'PENDING', now ms, deadline ms, last response id}  created; the marker expires at the deadline
    {0, current status, now ms, deadline ms, last response id, expired now (1/0), to agent, created ms}  the same
       request exists (a PENDING one is marked `joined`, so that its creator's `withdraw` leaves it
       to this caller). If its deadline had passed, this call made it EXPIRED and emitted EXPIRED:
       "expired now" is 1, telling the caller to take it out of its target's queue and count the
       expiry for that target (to agent: '' for a routed handoff not yet offered to one). Created
       ms: responses before it are an earlier handoff's under the same id (its record expired)
    {-5} the request id exists with a different request (another fingerprint)
    {-8} the requester is at its cap of undecided handoffs (nothing written)
    {-10} the staged envelope is gone (nothing written)
  The last response id lets the caller read KEYS[4] from a point before any response to
  this handoff, so no response can be missed.
]]
-- @include record

local hid, request_id, from, to = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local timeout_ms, envelope = tonumber(ARGV[5]), ARGV[6]
local retention_ms, response_retention_ms = tonumber(ARGV[7]), tonumber(ARGV[8])
local fingerprint = ARGV[9]
local staged = ARGV[15] == '1'

local existing = read_record(KEYS[1], {'fp', 'deadline', 'to', 'created'})
if existing.status then
  if staged then redis.call('DEL', KEYS[6]) end
  if existing.fp ~= fingerprint then return {-5} end
  local now = now_ms()
  local expired = 0
  if expire_if_due(KEYS, existing, request_id, now, retention_ms, response_retention_ms) then expired = 1 end
  if existing.status == 'PENDING' then redis.call('HSET', KEYS[1], 'joined', '1') end
  return {0, existing.status, fmt(now), existing.deadline, last_response_id(KEYS[4]), expired, existing.to or '',
    existing.created or '0'}
end

local cap = tonumber(ARGV[13] or 0)
if cap > 0 and redis.call('ZCARD', KEYS[3]) >= cap then
  if staged then redis.call('DEL', KEYS[6]) end
  return {-8}
end
local size = false  -- a staged envelope's, for reads to leave a large one to a plain GET
if staged then
  size = redis.call('STRLEN', KEYS[6])  -- 0: gone (an envelope is never empty)
  if size == 0 then return {-10} end
  redis.call('RENAME', KEYS[6], KEYS[5])
  redis.call('PERSIST', KEYS[5])  -- the staged copy's expiry only covered a lost call
else
  redis.call('SET', KEYS[5], envelope)
end
local now = now_ms()
local deadline = now + timeout_ms
local nows, deadlines = fmt(now), fmt(deadline)  -- each formatted once
local last = last_response_id(KEYS[4])
redis.call('HSET', KEYS[1],
  'id', hid, 'from', from, 'to', to, 'status', 'PENDING', 'actor', from,
  'created', nows, 'updated', nows, 'deadline', deadlines, 'fp', fingerprint,
  'hist', '[["PENDING","' .. from .. '",' .. nows .. ']]', 'rf', 'PENDING')
if size then redis.call('HSET', KEYS[1], 'esz', size) end
if ARGV[14] and ARGV[14] ~= '' then redis.call('HSET', KEYS[1], 'rsig', ARGV[14]) end
redis.call('SET', KEYS[2], '1', 'PXAT', deadlines)
redis.call('ZADD', KEYS[3], deadline, request_id)
if to == '' then
  -- capability routing: the route chain, refusals and deferrals live on the record
  redis.call('HSET', KEYS[1], 'routed', '1', 'caps', ARGV[10], 'prio', ARGV[11], 'chain', '[]',
    'refused', ',', 'deferred', ',')
  redis.call('ZADD', KEYS[3], now + tonumber(ARGV[12]), 'o:' .. request_id)
end
return {1, 'PENDING', nows, deadlines, last}
