--[[
  count: add one flush of a process's tally to an agent's stats hash (see handoffbus/stats.py
  for the fields), once: a flush whose reply was lost is sent again with its number, and one
  already added is not added twice.

  KEYS[1] stats hash   <p>:{A}:stats              (hash field -> integer, only ever incremented)
  KEYS[2] flushes added <p>:{A}:counted:<process> (zset of flush numbers; expires a day after
                        the process's last flush)
  ARGV[1] flush number (increasing per process)
  ARGV[2] the lowest flush number the process may still send: lower ones are forgotten
  ARGV[3..] field, increment, field, increment, ...

  Returns the number of fields incremented; 0 when this flush was added before.
]]
local flush = tonumber(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. ARGV[2])
if redis.call('ZSCORE', KEYS[2], ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[2], flush, ARGV[1])
redis.call('PEXPIRE', KEYS[2], 86400000)
for i = 3, #ARGV, 2 do
  redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1])
end
return (#ARGV - 2) / 2
