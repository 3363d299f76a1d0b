-- release.lua: give a hold's seats back, only where they still carry its token.
--
-- KEYS[1]          hold record (its key names the token)
-- KEYS[2 .. S]     the hold's seat keys
-- KEYS[S+1]        idempotency record
-- ARGV[1]          hold token
-- ARGV[2]          request fingerprint for the idempotency record
-- ARGV[3]          how long the idempotency record is kept, ms
--
-- A release always carries an idempotency record: the client's
-- Idempotency-Key, or one of the daemon's own for this request, so that a
-- resend of this script (its first reply lost with a broken connection)
-- answers as the first run did instead of "not found".
--
-- Returns 1 when the hold existed and is now gone, 0 when the token holds
-- nothing (expired, released, confirmed, or never existed), {-3, record}
-- when the idempotency record exists. A seat whose value is no longer this
-- token (expired and taken by someone else) is left alone.
local idem = KEYS[#KEYS]
local done = redis.call('GET', idem)
if done then
  return {-3, done}
end
local record = redis.call('GET', KEYS[1])
if not record or not string.match(record, '^%d') then
  return 0
end
for i = 2, #KEYS - 1 do
  if redis.call('GET', KEYS[i]) == ARGV[1] then
    redis.call('DEL', KEYS[i])
  end
end
redis.call('DEL', KEYS[1])
redis.call('SET', idem, ARGV[2] .. ' 204', 'PX', ARGV[3])
return 1
