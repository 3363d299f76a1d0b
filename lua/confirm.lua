-- confirm.lua: turn a hold into a sale, or acknowledge a sale made before;
-- a first sale writes the `confirmed` event of every involved show.
--
-- KEYS[1]            hold record (its key names the token)
-- KEYS[2]            sale record (created here, kept without TTL)
-- KEYS[3 .. 2+S]     the hold's seat keys
-- then per pool j = 1..P: the pool's hash and its holds
-- then per show h = 1..H: the holder's holds and bought units
-- then per involved show i = 1..E: deadline index, event stream
-- KEYS[#KEYS]        idempotency record, only when ARGV[2] is not empty
-- ARGV[1]            hold token
-- ARGV[2]            request fingerprint of an Idempotency-Key, or ""
-- ARGV[3]            how long the idempotency record is kept, ms
-- ARGV[4]            E, the number of involved shows with events on (0: off)
-- ARGV[5]            approximate length cap of each event stream
-- ARGV[6]            the hold's public ref
-- ARGV[7], ARGV[8]   P and H
-- then E items of show i ("E7 @floor=2"), P quantities, H units of show h
-- ARGV[#ARGV]        the fence of the record (hold or sale) the keys and
--                    items were read from (lookup.lua)
--
-- A sale turns the hold's pool units sold (`held` down, `sold` up) and
-- adds its units to the holder's bought count.
--
-- Returns {1, fence} when the token held every seat and each is now
-- "sold:<token>" without TTL (the hold record becomes the sale record);
-- {2, fence} when this token's sale already happened (it then writes the
-- sale record again, so that a WAIT after it has a write to count);
-- {0} when there is nothing to confirm (also when a pool entry of the hold
-- is gone: its units were given back); {-3} when the idempotency record to
-- write exists already (recorded since the daemon looked); {-7} when the record's fence is
-- another (a PATCH changed the hold since it was read: the keys above may
-- miss its seats and units; the daemon reads it again). Nothing changes
-- unless every seat still carries the token. A confirm is idempotent by itself, so an
-- idempotency record only remembers that this key confirmed this token: a
-- replay confirms again (answer {2, fence}) and WAITs again, because a 200
-- must still mean "replicated".
local token = ARGV[1]
local sold = 'sold:' .. token
local E, P, H = tonumber(ARGV[4]), tonumber(ARGV[7]), tonumber(ARGV[8])
local idem = ARGV[2] ~= '' and KEYS[#KEYS]
local last = #KEYS - 2 * (E + P + H) - (idem and 1 or 0)
local pk, hk = last + 1, last + 1 + 2 * P
local ek = hk + 2 * H
local ia, qa = 9, 9 + E
local ua = qa + P

-- The daemon looked the key up before, but another request under the same
-- key may have recorded since: it reads the key again and decides (a
-- replay, or 422), with nothing changed here.
if idem and redis.call('EXISTS', idem) == 1 then return {-3} end

local record = redis.call('GET', KEYS[1])
local fence = string.match(record or '', '^(%d+) ')
if fence then
  if fence ~= ARGV[#ARGV] then return {-7} end
  for i = 3, last do
    if redis.call('GET', KEYS[i]) ~= token then
      return {0}
    end
  end
  -- Units a script already gave back (it found the hold expired on Redis's
  -- clock; its record and seats wait for Redis to delete them, and a clock
  -- stepped back makes them look alive) are not sold again: that would
  -- sell more than the capacity.
  for j = 1, P do
    if not redis.call('ZSCORE', KEYS[pk + 2 * j - 1], ARGV[qa + j - 1] .. ':' .. token) then
      return {0}
    end
  end
  for i = 3, last do
    redis.call('SET', KEYS[i], sold)
  end
  redis.call('SET', KEYS[2], record)
  redis.call('DEL', KEYS[1])
  for j = 1, P do
    local q = ARGV[qa + j - 1]
    redis.call('ZREM', KEYS[pk + 2 * j - 1], q .. ':' .. token)
    redis.call('HINCRBY', KEYS[pk + 2 * j - 2], 'held', -q)
    redis.call('HINCRBY', KEYS[pk + 2 * j - 2], 'sold', q)
  end
  for h = 1, H do
    local n = ARGV[ua + h - 1]
    redis.call('ZREM', KEYS[hk + 2 * h - 2], n .. ':' .. token)
    redis.call('INCRBY', KEYS[hk + 2 * h - 1], n)
  end
  for i = 1, E do
    local items = ARGV[ia + i - 1]
    redis.call('ZREM', KEYS[ek + 2 * i - 2], ARGV[6] .. ' ' .. fence .. ' ' .. items,
      ARGV[6] .. ' > ' .. KEYS[ek + 2 * (i % E)])
    redis.call('XADD', KEYS[ek + 2 * i - 1], 'MAXLEN', '~', ARGV[5], '*',
      't', 'confirmed', 'r', ARGV[6], 's', items, 'f', fence)
  end
  if idem then
    redis.call('SET', idem, ARGV[2] .. ' 200 ' .. fence, 'PX', ARGV[3])
  end
  return {1, tonumber(fence)}
end

local sale = redis.call('GET', KEYS[2])
if sale then
  if (string.match(sale, '^(%d+) ') or '0') ~= ARGV[#ARGV] then return {-7} end
  for i = 3, last do
    if redis.call('GET', KEYS[i]) ~= sold then
      return {0}
    end
  end
  redis.call('SET', KEYS[2], sale)
  local fence = string.match(sale, '^(%d+) ') or '0'
  -- A retry after a failure (whose record the daemon removed) records its
  -- own answer.
  if idem then
    redis.call('SET', idem, ARGV[2] .. ' 200 ' .. fence, 'PX', ARGV[3])
  end
  return {2, tonumber(fence)}
end

return {0}
