-- abandon.lua: make sure a hold left without an answer leaves nothing held.
--
-- KEYS[1]          hold record of the abandoned token
-- KEYS[2 .. #KEYS] the hold's seat keys
-- ARGV[1]          hold token
-- ARGV[2]          the hold's TTL in milliseconds
--
-- The hold's request timed out or lost its connection after its script was
-- sent (or its client went away before the answer), and no Idempotency-Key
-- lets the client find it again: the daemon runs this until it succeeds.
-- If hold.lua ran, its seats are released (token-checked, as release.lua
-- does). If it has not run yet (a script can still wait in a paused or slow
-- master's queue), a tombstone takes the record's key for the hold's TTL,
-- so that hold.lua, finding its record key taken, writes nothing.
--
-- Either way the record's key is left as the tombstone for the hold's TTL,
-- so the hold cannot come back. Returns 1 when seats were released, 0 when
-- only the tombstone was left (or already was).
local record = redis.call('GET', KEYS[1])
if record == 'abandoned' then
  return 0
end
if record then
  for i = 2, #KEYS do
    if redis.call('GET', KEYS[i]) == ARGV[1] then
      redis.call('DEL', KEYS[i])
    end
  end
  -- The record becomes the tombstone: a resend of this hold's script that
  -- arrives late (the daemon resends a script whose connection broke)
  -- finds its record key taken and writes nothing.
  redis.call('SET', KEYS[1], 'abandoned', 'PX', ARGV[2])
  return 1
end
redis.call('SET', KEYS[1], 'abandoned', 'PX', ARGV[2])
return 0
