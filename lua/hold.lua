-- hold.lua: hold every seat under one token, all or nothing.
--
-- KEYS[1]              hold record to create (a string), under the home show
-- KEYS[2 .. 1+F]       fence counter of every distinct show of the hold
-- KEYS[2+F .. #KEYS]   seat keys, in request order
-- ARGV[1]              hold token (a fresh UUID v4)
-- ARGV[2]              TTL in milliseconds
-- ARGV[3]              F, the number of fence keys
-- ARGV[4]              kind: "s" (one show's route) or "m" (POST /v1/holds)
-- ARGV[5]              seats as "show/seat" joined with spaces, request order
--
-- The record is "<fence> <created_ms> <kind> <seats>" with the hold's TTL;
-- the token is in its key. One string rather than a hash: one write (SET
-- with PX) instead of HSET plus PEXPIRE, for the master and every replica.
--
-- Returns {1, fence, pttl_ms, now_ms} when every seat was free and is now
-- held; otherwise {0, i, state, pttl_ms, ...} for every taken seat (i is its
-- 1-based position in the request, state 1 = held, 2 = sold) and writes
-- nothing. Taken seats are a normal answer, not an error.
local fences = tonumber(ARGV[3])
local first = 2 + fences

local taken = {0}
for i = first, #KEYS do
  local v = redis.call('GET', KEYS[i])
  if v then
    local state = 1
    if string.sub(v, 1, 5) == 'sold:' then state = 2 end
    taken[#taken + 1] = i - first + 1
    taken[#taken + 1] = state
    taken[#taken + 1] = redis.call('PTTL', KEYS[i])
  end
end
if #taken > 1 then
  return taken
end

local fence
if fences == 1 then
  fence = redis.call('INCR', KEYS[2])
else
  -- The new fence must exceed every involved show's last one, so that each
  -- show's counter keeps increasing strictly.
  fence = 0
  for i = 2, first - 1 do
    local f = tonumber(redis.call('GET', KEYS[i]) or '0') or 0
    if f > fence then fence = f end
  end
  fence = fence + 1
  for i = 2, first - 1 do
    redis.call('SET', KEYS[i], string.format('%d', fence))
  end
end

for i = first, #KEYS do
  redis.call('SET', KEYS[i], ARGV[1], 'PX', ARGV[2])
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('SET', KEYS[1], string.format('%d %d %s %s', fence, now, ARGV[4], ARGV[5]), 'PX', ARGV[2])
return {1, fence, redis.call('PTTL', KEYS[1]), now}
