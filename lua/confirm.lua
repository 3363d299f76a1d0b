-- confirm.lua: turn a hold into a sale, or acknowledge a sale made before.
--
-- KEYS[1]          hold record (its key names the token)
-- KEYS[2]          sale record (created here, kept without TTL)
-- KEYS[3 .. S]     the hold's seat keys
-- KEYS[S+1]        idempotency record, only when ARGV[2] is not empty
-- ARGV[1]          hold token
-- ARGV[2]          request fingerprint of an Idempotency-Key, or ""
-- ARGV[3]          how long the idempotency record is kept, ms
--
-- Returns {1, fence} when the token held every seat and each is now
-- "sold:<token>" without TTL (the hold record becomes the sale record);
-- {2, fence} when this token's sale already happened (it then writes the
-- sale record again, so that a WAIT after it has a write to count);
-- {0} when there is nothing to confirm. Nothing changes unless every seat
-- still carries the token. A confirm is idempotent by itself, so an
-- idempotency record only remembers that this key confirmed this token: a
-- replay confirms again (answer {2, fence}) and WAITs again, because a 200
-- must still mean "replicated".
local token = ARGV[1]
local sold = 'sold:' .. token
local idem = ARGV[2] ~= '' and KEYS[#KEYS]
local last = idem and #KEYS - 1 or #KEYS

local record = redis.call('GET', KEYS[1])
if record and string.match(record, '^%d') then
  for i = 3, last do
    if redis.call('GET', KEYS[i]) ~= token then
      return {0}
    end
  end
  for i = 3, last do
    redis.call('SET', KEYS[i], sold)
  end
  redis.call('SET', KEYS[2], record)
  redis.call('DEL', KEYS[1])
  local fence = tonumber(string.match(record, '^(%d+) '))
  if idem then
    redis.call('SET', idem, string.format('%s 200 %d', ARGV[2], fence), 'PX', ARGV[3])
  end
  return {1, fence}
end

local sale = redis.call('GET', KEYS[2])
if sale then
  for i = 3, last do
    if redis.call('GET', KEYS[i]) ~= sold then
      return {0}
    end
  end
  redis.call('SET', KEYS[2], sale)
  return {2, tonumber(string.match(sale, '^(%d+) ')) or 0}
end

return {0}
