-- extend.lua: set a hold's remaining time, for every seat and its record.
--
-- KEYS[1]          hold record (its key names the token)
-- KEYS[2 .. #KEYS] the hold's seat keys
-- ARGV[1]          hold token
-- ARGV[2]          new TTL in milliseconds (like PEXPIRE)
-- ARGV[3]          longest lifetime of a hold in milliseconds, from creation
--
-- Returns {1, fence, pttl_ms, now_ms} when extended; {0} when the token no
-- longer holds every seat (nothing changed); {-1, created_ms, now_ms} when
-- the new expiry would pass the lifetime cap (nothing changed). Time is
-- Redis's own clock.
local record = redis.call('GET', KEYS[1])
if not record then
  return {0}
end
for i = 2, #KEYS do
  if redis.call('GET', KEYS[i]) ~= ARGV[1] then
    return {0}
  end
end
local fence, created = string.match(record, '^(%d+) (%d+) ')
fence, created = tonumber(fence) or 0, tonumber(created)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
created = created or now
if now + tonumber(ARGV[2]) - created > tonumber(ARGV[3]) then
  return {-1, created, now}
end
for i = 1, #KEYS do
  redis.call('PEXPIRE', KEYS[i], ARGV[2])
end
return {1, fence, redis.call('PTTL', KEYS[1]), now}
