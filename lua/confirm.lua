-- confirm.lua: turn a hold into a sale, or acknowledge a sale made before.
--
-- KEYS[1]          hold record
-- KEYS[2]          sale record (created here, kept without TTL)
-- KEYS[3 .. #KEYS] the hold's seat keys
-- ARGV[1]          hold token
--
-- Returns {1, fence} when the token held every seat and each is now
-- "sold:<token>" without TTL (the hold record becomes the sale record);
-- {2, fence} when this token's sale already happened (it then writes a
-- counter on the sale record, so that a WAIT after it has a write to count);
-- {0} when there is nothing to confirm. Nothing changes unless every seat
-- still carries the token.
local token = ARGV[1]
local sold = 'sold:' .. token

if redis.call('HGET', KEYS[1], 'token') == token then
  for i = 3, #KEYS do
    if redis.call('GET', KEYS[i]) ~= token then
      return {0}
    end
  end
  for i = 3, #KEYS do
    redis.call('SET', KEYS[i], sold)
  end
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local record = redis.call('HGETALL', KEYS[1])
  redis.call('HSET', KEYS[2], unpack(record))
  redis.call('HSET', KEYS[2], 'confirmed', string.format('%d', now), 'confirms', '1')
  redis.call('DEL', KEYS[1])
  return {1, tonumber(redis.call('HGET', KEYS[2], 'fence')) or 0}
end

if redis.call('HGET', KEYS[2], 'token') == token then
  for i = 3, #KEYS do
    if redis.call('GET', KEYS[i]) ~= sold then
      return {0}
    end
  end
  redis.call('HINCRBY', KEYS[2], 'confirms', 1)
  return {2, tonumber(redis.call('HGET', KEYS[2], 'fence')) or 0}
end

return {0}
