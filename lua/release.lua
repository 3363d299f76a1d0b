-- release.lua: give a hold's seats back, only where they still carry its
-- token, and write the `released` event of every involved show.
--
-- KEYS[1]            hold record (its key names the token)
-- KEYS[2 .. 1+S]     the hold's seat keys
-- KEYS[2+S ..]       per involved show i = 1..E: deadline index, event stream
-- KEYS[#KEYS]        idempotency record
-- ARGV[1]            hold token
-- ARGV[2]            request fingerprint for the idempotency record
-- ARGV[3]            how long the idempotency record is kept, ms
-- ARGV[4]            E, the number of involved shows with events on (0: off)
-- ARGV[5]            approximate length cap of each event stream
-- ARGV[6]            the hold's public ref
-- ARGV[7 .. 6+E]     show i's seat ids, joined with spaces
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
local shows = tonumber(ARGV[4])
local idem = KEYS[#KEYS]
local last = #KEYS - 1 - 2 * shows
local done = redis.call('GET', idem)
if done then
  return {-3, done}
end
local record = redis.call('GET', KEYS[1])
local fence = string.match(record or '', '^(%d+) ')
if not fence then
  return 0
end
for i = 2, last do
  if redis.call('GET', KEYS[i]) == ARGV[1] then
    redis.call('DEL', KEYS[i])
  end
end
redis.call('DEL', KEYS[1])
for i = 1, shows do
  local seats = ARGV[6 + i]
  redis.call('ZREM', KEYS[last + 2 * i - 1], ARGV[6] .. ' ' .. fence .. ' ' .. seats)
  redis.call('XADD', KEYS[last + 2 * i], 'MAXLEN', '~', ARGV[5], '*',
    't', 'released', 'r', ARGV[6], 's', seats, 'f', fence)
end
redis.call('SET', idem, ARGV[2] .. ' 204', 'PX', ARGV[3])
return 1
