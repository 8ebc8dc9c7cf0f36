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
