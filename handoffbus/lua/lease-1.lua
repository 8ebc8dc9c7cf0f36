--[[
  lease: take or renew a lease held under a random token (the expiry sweep's).

  KEYS[1] lease key
  ARGV[1] token   ARGV[2] lease time ms (0 releases the lease if the caller holds it)

  Returns 1 if the caller holds the lease for the next ARGV[2] ms (or released it), 0 if
  another holder does.
]]
-- @flags allow-oom
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
if tonumber(ARGV[2]) == 0 then
  redis.call('DEL', KEYS[1])
  return 1
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
