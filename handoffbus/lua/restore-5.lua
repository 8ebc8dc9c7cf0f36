--[[
  restore: recreate an agent's consumer group after it (or its inbox stream) was deleted
  under running workers, and give every in-flight handoff a new pending entry (see
  ensure_group in includes/queue.lua). A worker runs it when a read of its group fails with
  NOGROUP. Nothing is lost: the in-flight index and the handoff records outlive the stream.

  KEYS[1] queue   KEYS[2] inbox   KEYS[3] in-flight index   KEYS[4] sequence   KEYS[5] doorbell
  ARGV[1] consumer group

  Returns the number of in-flight handoffs restored (0: the group existed).
]]
-- @flags allow-oom
-- @include holder
-- @include queue

return ensure_group(ARGV[1])
