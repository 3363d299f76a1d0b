-- release.lua: give a hold's seats back, only where they still carry its token.
--
-- KEYS[1]          hold record (its key names the token)
-- KEYS[2 .. #KEYS] the hold's seat keys
-- ARGV[1]          hold token
--
-- Returns 1 when the hold existed and is now gone, 0 when the token holds
-- nothing (expired, released, confirmed, or never existed). A seat whose
-- value is no longer this token (expired and taken by someone else) is left
-- alone.
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
for i = 2, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[1] then
    redis.call('DEL', KEYS[i])
  end
end
redis.call('DEL', KEYS[1])
return 1
