#!lua flags=no-writes
-- lookup.lua: read a hold (or the sale it became) by token. Read-only.
--
-- KEYS[1] hold record
-- KEYS[2] sale record (read only when ARGV[1] is "1")
-- KEYS[3] idempotency record (optional)
-- ARGV[1] "1" to look for the sale record too
--
-- Returns {found, pttl_ms, now_ms, record, idempotency record or nil}:
-- found is 1 for a live hold, 2 for a confirmed one (pttl -1), 0 for
-- nothing (record nil). A record is "<fence> <created_ms> <kind> <seats>"
-- (see hold.lua); an abandoned hold's tombstone is not one.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local done = KEYS[3] and redis.call('GET', KEYS[3])
local record = redis.call('GET', KEYS[1])
if record and string.match(record, '^%d') then
  -- From the expiry itself, not PTTL: PTTL reads the clock again, and when
  -- it has moved to the next millisecond since TIME, now + PTTL is 1 ms
  -- short of the expiry that the hold's other answers give.
  local at = redis.call('PEXPIRETIME', KEYS[1])
  local pttl = at
  if at >= 0 then pttl = math.max(at - now, 0) end
  return {1, pttl, now, record, done}
end
if ARGV[1] == '1' then
  record = redis.call('GET', KEYS[2])
  if record then
    return {2, -1, now, record, done}
  end
end
return {0, -2, now, false, done}
