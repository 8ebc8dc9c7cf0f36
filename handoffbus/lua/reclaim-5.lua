--[[
  reclaim: start another run of an ACCEPTED handoff's work. Either a live worker of the
  owning agent takes over a handoff whose worker stopped (its inbox entry was claimed after
  sitting idle), or the lease holder retries its own raising handler. The lease moves to
  the caller and the attempt count rises; a previous holder can no longer finish it.
  Nothing is emitted: the requester has heard ACCEPTED already.

  KEYS[1] record hash   KEYS[2] pending marker   KEYS[3] deadline index   KEYS[4] response stream
  KEYS[5] request envelope
  ARGV[1] handoff id    ARGV[2] request id       ARGV[3] acting agent    ARGV[4] new lease (consumer)
  ARGV[5] expected current lease, or '' for a takeover (a retry must still hold the lease)
  ARGV[6] the attempt the caller saw last (optional): the lease already the caller's at the
          attempt after it is a repeat of this call whose reply was lost, answered as done

  Returns:
    {1, attempt}  the caller holds the lease now, for this attempt
    {-1} no such handoff   {-2, current status} it is not ACCEPTED (nothing to take over)
    {-4} the acting agent is not the one that accepted it
    {-6, holder} a retry whose caller no longer holds the lease
]]
-- @flags allow-oom
local rec = redis.call('HMGET', KEYS[1], 'status', 'agent', 'attempt', 'lease')
if not rec[1] then return {-1} end
if rec[1] ~= 'ACCEPTED' then return {-2, rec[1]} end
if rec[2] ~= ARGV[3] then return {-4} end
local seen = tonumber(ARGV[6] or '')
if seen and rec[4] == ARGV[4] and tonumber(rec[3]) == seen + 1 then return {1, seen + 1} end
if ARGV[5] ~= '' and rec[4] ~= ARGV[5] then return {-6, rec[4] or ''} end
local attempt = (tonumber(rec[3]) or 1) + 1
redis.call('HSET', KEYS[1], 'lease', ARGV[4], 'attempt', attempt)
return {1, attempt}
