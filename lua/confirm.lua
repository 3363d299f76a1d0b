-- confirm.lua: turn a hold into a sale, or acknowledge a sale made before;
-- a first sale writes the `confirmed` event of every involved show.
--
-- KEYS[1]            hold record (its key names the token)
-- KEYS[2]            sale record (created here, kept without TTL)
-- KEYS[3 .. 2+S]     the hold's seat keys
-- KEYS[3+S ..]       per involved show i = 1..E: deadline index, event stream
-- KEYS[#KEYS]        idempotency record, only when ARGV[2] is not empty
-- ARGV[1]            hold token
-- ARGV[2]            request fingerprint of an Idempotency-Key, or ""
-- ARGV[3]            how long the idempotency record is kept, ms
-- ARGV[4]            E, the number of involved shows with events on (0: off)
-- ARGV[5]            approximate length cap of each event stream
-- ARGV[6]            the hold's public ref
-- ARGV[7 .. 6+E]     show i's seat ids, joined with spaces
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
local shows = tonumber(ARGV[4])
local idem = ARGV[2] ~= '' and KEYS[#KEYS]
local last = #KEYS - 2 * shows - (idem and 1 or 0)

local record = redis.call('GET', KEYS[1])
local fence = string.match(record or '', '^(%d+) ')
if fence then
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
  for i = 1, shows do
    local seats = ARGV[6 + i]
    redis.call('ZREM', KEYS[last + 2 * i - 1], ARGV[6] .. ' ' .. fence .. ' ' .. seats)
    redis.call('XADD', KEYS[last + 2 * i], 'MAXLEN', '~', ARGV[5], '*',
      't', 'confirmed', 'r', ARGV[6], 's', seats, 'f', fence)
  end
  if idem then
    redis.call('SET', idem, ARGV[2] .. ' 200 ' .. fence, 'PX', ARGV[3])
  end
  return {1, tonumber(fence)}
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
