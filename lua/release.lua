-- release.lua: give a hold's seats back, only where they still carry its
-- token, and write the `released` event of every involved show.
--
-- KEYS[1]            hold record (its key names the token)
-- KEYS[2 .. 1+S]     the hold's seat keys
-- then per pool j = 1..P: the pool's hash and its holds
-- then per show h = 1..H: the holder's holds and bought units
-- then per involved show i = 1..E: deadline index, event stream
-- KEYS[#KEYS]        idempotency record
-- ARGV[1]            hold token
-- ARGV[2]            request fingerprint for the idempotency record
-- ARGV[3]            how long the idempotency record is kept, ms
-- ARGV[4]            E, the number of involved shows with events on (0: off)
-- ARGV[5]            approximate length cap of each event stream
-- ARGV[6]            the hold's public ref
-- ARGV[7], ARGV[8]   P and H
-- then E items of show i ("E7 @floor=2"), P quantities, H units of show h
-- ARGV[#ARGV]        the fence of the record the keys and items were read
--                    from (lookup.lua)
--
-- A release always carries an idempotency record: the client's
-- Idempotency-Key, or one of the daemon's own for this request, so that a
-- resend of this script (its first reply lost with a broken connection)
-- answers as the first run did instead of "not found".
--
-- Returns 1 when the hold existed and is now gone, 0 when the token holds
-- nothing (expired, released, confirmed, or never existed), {-3, record}
-- when the idempotency record exists, -7 when the record's fence is another
-- (a PATCH changed the hold since it was read: the keys above may miss its
-- seats and units; the daemon reads it again). A seat whose value is no longer this
-- token (expired and taken by someone else) is left alone.
local E, P, H = tonumber(ARGV[4]), tonumber(ARGV[7]), tonumber(ARGV[8])
local idem = KEYS[#KEYS]
local last = #KEYS - 1 - 2 * (E + P + H)
local pk, hk = last + 1, last + 1 + 2 * P
local ek = hk + 2 * H
local ia, qa = 9, 9 + E
local ua = qa + P
local done = redis.call('GET', idem)
if done then
  return {-3, done}
end
local record = redis.call('GET', KEYS[1])
local fence = string.match(record or '', '^(%d+) ')
if not fence then
  return 0
end
if fence ~= ARGV[#ARGV] then
  return -7
end
-- Seats the token no longer holds (taken by another writer since), which
-- the event must not name as given back.
local lost
for i = 2, last do
  if redis.call('GET', KEYS[i]) == ARGV[1] then
    redis.call('DEL', KEYS[i])
  else
    lost = lost or {}
    lost[KEYS[i]] = true
  end
end
-- Show i's items without its lost seats: a seat item "E7" is the key
-- "<the show's tag>:E7", the tag being its stream's key without "#events".
local function given_back(i)
  local items = ARGV[ia + i - 1]
  if not lost then return items end
  local tag = string.sub(KEYS[ek + 2 * i - 1], 1, -8)
  local kept = {}
  for item in string.gmatch(items, '%S+') do
    if string.sub(item, 1, 1) == '@' or not lost[tag .. ':' .. item] then
      kept[#kept + 1] = item
    end
  end
  return table.concat(kept, ' ')
end
redis.call('DEL', KEYS[1])
-- Units go back to their pools, unless they already went back by expiry.
for j = 1, P do
  local q = ARGV[qa + j - 1]
  if redis.call('ZREM', KEYS[pk + 2 * j - 1], q .. ':' .. ARGV[1]) == 1 then
    redis.call('HINCRBY', KEYS[pk + 2 * j - 2], 'held', -q)
  end
end
for h = 1, H do
  redis.call('ZREM', KEYS[hk + 2 * h - 2], ARGV[ua + h - 1] .. ':' .. ARGV[1])
end
for i = 1, E do
  local items = ARGV[ia + i - 1]
  redis.call('ZREM', KEYS[ek + 2 * i - 2], ARGV[6] .. ' ' .. fence .. ' ' .. items,
    ARGV[6] .. ' > ' .. KEYS[ek + 2 * (i % E)])
  redis.call('XADD', KEYS[ek + 2 * i - 1], 'MAXLEN', '~', ARGV[5], '*',
    't', 'released', 'r', ARGV[6], 's', given_back(i), 'f', fence)
end
redis.call('SET', idem, ARGV[2] .. ' 204', 'PX', ARGV[3])
return 1
