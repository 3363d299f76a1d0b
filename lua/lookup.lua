#!lua flags=no-writes
-- lookup.lua: read a hold (or the sale it became) by token. Read-only.
--
-- KEYS[1] hold record
-- KEYS[2] sale record (optional)
--
-- Returns {1, pttl_ms, now_ms, record} for a live hold, {2, -1, now_ms,
-- record} for a confirmed one, {0} otherwise. A record is
-- "<fence> <created_ms> <kind> <seats>" (see hold.lua).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local record = redis.call('GET', KEYS[1])
if record then
  return {1, redis.call('PTTL', KEYS[1]), now, record}
end
if #KEYS >= 2 then
  record = redis.call('GET', KEYS[2])
  if record then
    return {2, -1, now, record}
  end
end
return {0}
