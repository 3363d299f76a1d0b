#!lua flags=no-writes
-- seats.lua: the state of seats of one slot. Read-only.
--
-- KEYS[1 .. #KEYS] seat keys
--
-- Returns {state, pttl_ms, ...}, a pair per key in order: state 0 = free,
-- 1 = held (pttl_ms is the remaining time, -1 when the key has no TTL),
-- 2 = sold.
local out = {}
for i = 1, #KEYS do
  local v = redis.call('GET', KEYS[i])
  if not v then
    out[#out + 1] = 0
    out[#out + 1] = -2
  elseif string.sub(v, 1, 5) == 'sold:' then
    out[#out + 1] = 2
    out[#out + 1] = -1
  else
    out[#out + 1] = 1
    out[#out + 1] = redis.call('PTTL', KEYS[i])
  end
end
return out
