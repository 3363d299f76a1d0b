-- confirm.lua: turn a hold into a sale, or acknowledge a sale made before.
--
-- KEYS[1]          hold record (its key names the token)
-- KEYS[2]          sale record (created here, kept without TTL)
-- KEYS[3 .. #KEYS] the hold's seat keys
-- ARGV[1]          hold token
--
-- Returns {1, fence} when the token held every seat and each is now
-- "sold:<token>" without TTL (the hold record becomes the sale record);
-- {2, fence} when this token's sale already happened (it then writes the
-- sale record again, so that a WAIT after it has a write to count);
-- {0} when there is nothing to confirm. Nothing changes unless every seat
-- still carries the token.
local token = ARGV[1]
local sold = 'sold:' .. token

local record = redis.call('GET', KEYS[1])
if record then
  for i = 3, #KEYS do
    if redis.call('GET', KEYS[i]) ~= token then
      return {0}
    end
  end
  for i = 3, #KEYS do
    redis.call('SET', KEYS[i], sold)
  end
  redis.call('SET', KEYS[2], record)
  redis.call('DEL', KEYS[1])
  return {1, tonumber(string.match(record, '^(%d+) ')) or 0}
end

local sale = redis.call('GET', KEYS[2])
if sale then
  for i = 3, #KEYS do
    if redis.call('GET', KEYS[i]) ~= sold then
      return {0}
    end
  end
  redis.call('SET', KEYS[2], sale)
  return {2, tonumber(string.match(sale, '^(%d+) ')) or 0}
end

return {0}
