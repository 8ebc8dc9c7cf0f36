--[[
  unlisted: the sweep's note of the requesters it took out of the requesters set as idle, in
  the server's time: each is looked at once more when every process's memory of having listed
  it has lapsed (see Sweeper.unlist_idle and Sweeper.recheck_unlisted).

  KEYS[1] the note  <p>:unlisted  (zset: requester -> when it was unlisted, server ms)
  ARGV[1] "note": ARGV[2..] the requesters about to be unlisted
          "due":  ARGV[2] ms after which a noted requester is due, ARGV[3] how many at most

  Returns: "note": how many were noted. "due": the requesters noted at least ARGV[2] ms ago,
  oldest first, at most ARGV[3] (the caller removes each once it has looked at it).
]]
-- @include record

local now = now_ms()
if ARGV[1] == 'note' then
  for i = 2, #ARGV do
    redis.call('ZADD', KEYS[1], fmt(now), ARGV[i])
  end
  return #ARGV - 1
end
return redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', fmt(now - tonumber(ARGV[2])), 'LIMIT', 0, tonumber(ARGV[3]))
