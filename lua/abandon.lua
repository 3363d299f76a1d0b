-- abandon.lua: make sure a hold left without an answer leaves nothing held.
--
-- KEYS[1]            hold record of the abandoned token
-- KEYS[2 .. 1+S]     the hold's seat keys
-- then per pool j = 1..P: the pool's hash and its holds
-- then per show h = 1..H: the holder's holds and bought units
-- then per involved show i = 1..E: deadline index, event stream
-- KEYS[#KEYS]        with events off only (E = 0): the claim of the hold's
--                    expiry (see src/expiry.rs)
-- ARGV[1]            hold token
-- ARGV[2]            the hold's TTL in milliseconds
-- ARGV[3]            E, the number of involved shows with events on (0: off)
-- ARGV[4]            approximate length cap of each event stream
-- ARGV[5]            the hold's public ref
-- ARGV[6], ARGV[7]   P and H
-- then E items of show i ("E7 @floor=2"), P quantities, H units of show h
--
-- The hold's request timed out or lost its connection after its script was
-- sent (or its client went away before the answer), and no Idempotency-Key
-- lets the client find it again: the daemon runs this until it succeeds. If hold.lua ran, its seats are released
-- (token-checked, as release.lua does, with a `released` event). If it has
-- not run yet (a script can still wait in a paused or slow master's queue),
-- a tombstone takes the record's key for the hold's TTL, so that hold.lua,
-- finding its record key taken, writes nothing.
--
-- Either way the record's key is left as the tombstone for the hold's TTL,
-- so the hold cannot come back. With events off, daemons count an expiry
-- when they hear a record's key expire, and the tombstone's would be heard
-- too: the expiry is claimed here, for longer than the tombstone and the
-- daemons' own claim last, so that none counts it. Returns 1 when seats
-- were released, 0 when only the tombstone was left (or already was).
local E, P, H = tonumber(ARGV[3]), tonumber(ARGV[6]), tonumber(ARGV[7])
local last = #KEYS - 2 * (E + P + H)
local function tombstone()
  redis.call('SET', KEYS[1], 'abandoned', 'PX', ARGV[2])
  if E == 0 then
    redis.call('SET', KEYS[#KEYS], '1', 'PX', tonumber(ARGV[2]) + 120000)
  end
end
if E == 0 then last = last - 1 end
local pk, hk = last + 1, last + 1 + 2 * P
local ek = hk + 2 * H
local ia, qa = 8, 8 + E
local ua = qa + P
local record = redis.call('GET', KEYS[1])
if record == 'abandoned' then
  return 0
end
if not record then
  tombstone()
  return 0
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
-- The record becomes the tombstone: a resend of this hold's script that
-- arrives late (the daemon resends a script whose connection broke) finds
-- its record key taken and writes nothing.
tombstone()
local fence = string.match(record, '^(%d+) ') or '0'
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
  redis.call('ZREM', KEYS[ek + 2 * i - 2], ARGV[5] .. ' ' .. fence .. ' ' .. items,
    ARGV[5] .. ' > ' .. KEYS[ek + 2 * (i % E)])
  redis.call('XADD', KEYS[ek + 2 * i - 1], 'MAXLEN', '~', ARGV[4], '*',
    't', 'released', 'r', ARGV[5], 's', given_back(i), 'f', fence)
end
return 1
