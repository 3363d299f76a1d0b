-- abandon.lua: make sure a hold answered 503 leaves nothing held.
--
-- KEYS[1]            hold record of the abandoned token
-- KEYS[2 .. 1+S]     the hold's seat keys
-- KEYS[2+S ..]       per involved show i = 1..E: deadline index, event stream
-- ARGV[1]            hold token
-- ARGV[2]            the hold's TTL in milliseconds
-- ARGV[3]            E, the number of involved shows with events on (0: off)
-- ARGV[4]            approximate length cap of each event stream
-- ARGV[5]            the hold's public ref
-- ARGV[6 .. 5+E]     show i's seat ids, joined with spaces
--
-- The hold's request timed out or lost its connection after its script was
-- sent, and no Idempotency-Key lets the client find it again: the daemon
-- runs this until it succeeds. If hold.lua ran, its seats are released
-- (token-checked, as release.lua does, with a `released` event). If it has
-- not run yet (a script can still wait in a paused or slow master's queue),
-- a tombstone takes the record's key for the hold's TTL, so that hold.lua,
-- finding its record key taken, writes nothing.
--
-- Returns 1 when seats were released, 0 when the tombstone was left (or
-- already was).
local shows = tonumber(ARGV[3])
local last = #KEYS - 2 * shows
local record = redis.call('GET', KEYS[1])
if record == 'abandoned' then
  return 0
end
if not record then
  redis.call('SET', KEYS[1], 'abandoned', 'PX', ARGV[2])
  return 0
end
for i = 2, last do
  if redis.call('GET', KEYS[i]) == ARGV[1] then
    redis.call('DEL', KEYS[i])
  end
end
redis.call('DEL', KEYS[1])
local fence = string.match(record, '^(%d+) ') or '0'
for i = 1, shows do
  local seats = ARGV[5 + i]
  redis.call('ZREM', KEYS[last + 2 * i - 1], ARGV[5] .. ' ' .. fence .. ' ' .. seats)
  redis.call('XADD', KEYS[last + 2 * i], 'MAXLEN', '~', ARGV[4], '*',
    't', 'released', 'r', ARGV[5], 's', seats, 'f', fence)
end
return 1
