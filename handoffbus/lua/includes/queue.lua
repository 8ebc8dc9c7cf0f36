--[[
  Shared helpers for scripts in a target agent's slot. Every queue script receives:

    KEYS[1] priority queue   <p>:{T}:queue     (zset handoff id -> priority * 2^42 + seq)
    KEYS[2] inbox stream     <p>:{T}:inbox     (consumer group "workers"; entries: h = handoff id)
    KEYS[3] in-flight index  <p>:{T}:inflight  (hash handoff id -> inbox entry id)
    KEYS[4] sequence         <p>:{T}:seq       (counter: FIFO order within a priority)
    KEYS[5] doorbell         <p>:{T}:bell      (stream, MAXLEN 1: rung on every enqueue)
]]

-- Remove a handoff from the queue, or acknowledge and delete its in-flight inbox entry.
local function settle(group, hid)
  local removed = redis.call('ZREM', KEYS[1], hid)
  local entry = redis.call('HGET', KEYS[3], hid)
  if entry then
    redis.call('XACK', KEYS[2], group, entry)
    redis.call('XDEL', KEYS[2], entry)
    redis.call('HDEL', KEYS[3], hid)
    removed = removed + 1
  end
  return removed
end

-- Add handoffs to the inbox and deliver them to `consumer` at once, so they sit in its
-- pending entries list from the first moment. Appends {handoff id, entry id} pairs to `out`.
-- The group is created if missing (first use, or deleted under running workers) at the
-- stream's end, so that '>' delivers exactly the entries added here. Entries a deleted group
-- had delivered stay listed in KEYS[3] with their records, for recovery.
local function deliver(group, consumer, hids, out)
  if #hids == 0 then return out end
  pcall(redis.call, 'XGROUP', 'CREATE', KEYS[2], group, '$', 'MKSTREAM')
  for _, hid in ipairs(hids) do
    local entry = redis.call('XADD', KEYS[2], '*', 'h', hid)
    redis.call('HSET', KEYS[3], hid, entry)
    out[#out + 1] = hid
    out[#out + 1] = entry
  end
  -- deliver what was just added (nothing else is undelivered: only deliver() adds entries)
  redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', #hids, 'STREAMS', KEYS[2], '>')
  return out
end
