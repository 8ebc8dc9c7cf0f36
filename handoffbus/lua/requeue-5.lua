--[[
  requeue: give a handoff back to its agent's queue from a worker that took it but stopped
  before deciding it: settle its inbox entry and queue it again in one step, so that it is
  never in neither (two calls could lose it to a failure between them).

  KEYS[1] queue   KEYS[2] inbox   KEYS[3] in-flight index   KEYS[4] sequence   KEYS[5] doorbell
  ARGV[1] consumer group   ARGV[2] handoff id
  ARGV[3] priority (integer, -1000..1000; lower is served first)
  ARGV[4] the consumer giving it back
  ARGV[5] '1' = settle it only, not queue it again: a routed handoff, which its worker then
          releases to its capability set (see release-5.lua); its entry is settled first, and
          only if this consumer holds it, so that a handoff another worker claimed is left to it

  Returns 1 (queued again, behind the handoffs of its priority already queued; or settled only), or 0 (left
  alone: settled meanwhile, as a cancel or an expiry settles it, so the in-flight index no
  longer holds it; or its entry is pending under another consumer, which claimed it while
  this one was slow and may have accepted it by now; a restored entry not yet adopted counts
  as this one's).
  Events: one entry on KEYS[5] (MAXLEN 1) so blocked workers wake (none when settled only).
]]
-- @flags allow-oom
-- @include holder
-- @include queue

local hid = ARGV[2]
local entry = redis.call('HGET', KEYS[3], hid)
if not entry or held_elsewhere(KEYS[2], ARGV[1], entry, ARGV[4]) then return 0 end
settle(ARGV[1], {hid})
if ARGV[5] == '1' then return 1 end
-- priority * 2^42 + seq, as enqueue scores it
redis.call('ZADD', KEYS[1], tonumber(ARGV[3]) * 4398046511104 + redis.call('INCR', KEYS[4]), hid)
redis.call('XADD', KEYS[5], 'MAXLEN', 1, '*', 'h', hid)
return 1
