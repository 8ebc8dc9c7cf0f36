--[[
  Shared helpers for scripts in a target agent's slot. Every queue script receives:

    KEYS[1] priority queue   <p>:{T}:queue     (zset handoff id -> priority * 2^42 + seq)
    KEYS[2] inbox stream     <p>:{T}:inbox     (consumer group "workers"; entries: h = handoff id)
    KEYS[3] in-flight index  <p>:{T}:inflight  (hash handoff id -> inbox entry id)
    KEYS[4] sequence         <p>:{T}:seq       (counter: FIFO order within a priority)
    KEYS[5] doorbell         <p>:{T}:bell      (stream, MAXLEN 1: rung on every enqueue)

  Pasted after "holder" (RESTORED).
]]

-- Lua's unpack() takes a few thousand values at most: longer lists go in slices of this many.
local SLICE = 1000

-- Remove handoffs from the queue, and acknowledge and delete their in-flight inbox entries:
-- a handful of commands for the whole list, not five per handoff. Returns how many queue
-- members and inbox entries were removed.
local function settle(group, hids)
  local removed, seen, unique = 0, {}, {}
  for _, hid in ipairs(hids) do
    if not seen[hid] then seen[hid] = true; unique[#unique + 1] = hid end
  end
  for first = 1, #unique, SLICE do
    local slice = {unpack(unique, first, math.min(first + SLICE - 1, #unique))}
    removed = removed + redis.call('ZREM', KEYS[1], unpack(slice))
    local entries = redis.call('HMGET', KEYS[3], unpack(slice))
    local ids, held = {}, {}
    for i = 1, #slice do
      if entries[i] then ids[#ids + 1] = entries[i]; held[#held + 1] = slice[i] end
    end
    if #ids > 0 then
      redis.call('XACK', KEYS[2], group, unpack(ids))
      redis.call('XDEL', KEYS[2], unpack(ids))
      redis.call('HDEL', KEYS[3], unpack(held))
      removed = removed + #ids
    end
  end
  return removed
end

-- Create the consumer group if it is missing: on first use, or when the group or the whole
-- stream was deleted under running workers. In the latter case every in-flight handoff
-- (KEYS[3], the index that outlives both) lost its pending entry: each gets a new entry,
-- delivered to RESTORED, and its old entry (if the stream survived) is deleted. The group
-- starts at the stream's end, so only the entries added after this are ever delivered.
-- Returns how many in-flight handoffs were restored.
local function ensure_group(group)
  if not pcall(redis.call, 'XGROUP', 'CREATE', KEYS[2], group, '$', 'MKSTREAM') then return 0 end
  local flat = redis.call('HGETALL', KEYS[3])
  for i = 1, #flat, 2 do
    redis.call('XDEL', KEYS[2], flat[i + 1])
    redis.call('HSET', KEYS[3], flat[i], redis.call('XADD', KEYS[2], '*', 'h', flat[i]))
  end
  if #flat > 0 then
    redis.call('XREADGROUP', 'GROUP', group, RESTORED, 'COUNT', #flat / 2, 'STREAMS', KEYS[2], '>')
  end
  return #flat / 2
end

-- Add handoffs to the inbox and deliver them to `consumer` at once, so they sit in its
-- pending entries list from the first moment. Appends {handoff id, entry id} pairs to `out`.
local function deliver(group, consumer, hids, out)
  if #hids == 0 then return out end
  ensure_group(group)
  local index = {}
  for _, hid in ipairs(hids) do
    local entry = redis.call('XADD', KEYS[2], '*', 'h', hid)
    index[#index + 1] = hid
    index[#index + 1] = entry
    out[#out + 1] = hid
    out[#out + 1] = entry
  end
  for first = 1, #index, SLICE do
    redis.call('HSET', KEYS[3], unpack(index, first, math.min(first + SLICE - 1, #index)))
  end
  -- deliver what was just added (nothing else is undelivered: only this file adds entries)
  redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', #hids, 'STREAMS', KEYS[2], '>')
  return out
end
