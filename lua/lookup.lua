#!lua flags=no-writes
-- lookup.lua: read a hold (or the sale it became) by token. Read-only.
--
-- KEYS[1] hold record
-- KEYS[2] sale record (optional)
--
-- Returns {1, pttl_ms, now_ms, field, value, ...} for a live hold,
-- {2, -1, now_ms, field, value, ...} for a confirmed one, {0} otherwise.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local record = redis.call('HGETALL', KEYS[1])
local found = 1
local pttl = -1
if #record > 0 then
  pttl = redis.call('PTTL', KEYS[1])
elseif #KEYS >= 2 then
  record = redis.call('HGETALL', KEYS[2])
  found = 2
end
if #record == 0 then
  return {0}
end
local out = {found, pttl, now}
for i = 1, #record do
  out[#out + 1] = record[i]
end
return out
