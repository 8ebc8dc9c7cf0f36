--[[
  blob: read a piece of a context's out-of-band content (read only). A script so that an
  isolated agent's read of a peer's blob travels through the forwarder, which checks it
  against the handoff named by KEYS[2] (see forwarding.py); other buses read blobs plainly.

  KEYS[1] blob key      <p>:{R}:blob:<sha256>
  KEYS[2] record hash   <p>:{R}:h:<request_id>  (the handoff whose context refers to it)

  Returns the content, or false (nil) when it is gone.
]]
-- @flags no-writes
return redis.call('GET', KEYS[1])
