--[[
  count: add increments to an agent's stats hash (see handoffbus/stats.py for the fields).

  KEYS[1] stats hash   <p>:{A}:stats   (hash field -> integer, only ever incremented)
  ARGV[1..] field, increment, field, increment, ...

  Returns the number of fields incremented.
]]
for i = 1, #ARGV, 2 do
  redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1])
end
return #ARGV / 2
