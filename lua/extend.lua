-- extend.lua: set a hold's remaining time, for every seat, its record and
-- its deadlines, and write the `extended` event of every involved show.
--
-- KEYS[1]            hold record (its key names the token)
-- KEYS[2 .. 1+S]     the hold's seat keys
-- then per pool j = 1..P: the pool's hash and its holds
-- then per show h = 1..H: the holder's holds and bought units
-- then per involved show i = 1..E: deadline index, event stream
-- KEYS[#KEYS]        idempotency record, only when ARGV[4] is not empty
-- ARGV[1]            hold token
-- ARGV[2]            new TTL in milliseconds (like PEXPIRE)
-- ARGV[3]            longest lifetime of a hold in milliseconds, from creation
-- ARGV[4]            request fingerprint of an Idempotency-Key, or ""
-- ARGV[5]            how long the idempotency record is kept, ms
-- ARGV[6]            E, the number of involved shows with events on (0: off)
-- ARGV[7]            approximate length cap of each event stream
-- ARGV[8]            the hold's public ref
-- ARGV[9], ARGV[10]  P and H
-- then E items of show i ("E7 @floor=2"), P quantities, H units of show h
-- ARGV[#ARGV]        the fence of the record the keys and items were read
--                    from (lookup.lua)
--
-- Returns {1, fence, pttl_ms, now_ms} when extended; {0} when the token no
-- longer holds every seat, a pool's units were given back or the holder's
-- set no longer counts the hold (nothing changed); {-7} when the record's fence
-- is another (a PATCH changed the hold since it was read: the keys above
-- may miss its seats; the daemon reads it again); {-1, created_ms, now_ms} when
-- the new expiry would pass the lifetime cap (nothing changed); {-3, record,
-- now_ms} when the idempotency record exists. Time is Redis's own clock.
-- The daemon runs every extend under an idempotency key (its own when the
-- client sent none), so a resend of this script after a lost reply finds
-- the first run's record instead of extending again.
local E, P, H = tonumber(ARGV[6]), tonumber(ARGV[9]), tonumber(ARGV[10])
local idem = ARGV[4] ~= '' and KEYS[#KEYS]
local last = #KEYS - 2 * (E + P + H) - (idem and 1 or 0)
local pk, hk = last + 1, last + 1 + 2 * P
local ek = hk + 2 * H
local ia, qa = 11, 11 + E
local ua = qa + P
if idem then
  local done = redis.call('GET', idem)
  if done then
    local t = redis.call('TIME')
    return {-3, done, tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)}
  end
end
local record = redis.call('GET', KEYS[1])
local fence, created = string.match(record or '', '^(%d+) (%d+) ')
if not fence then
  return {0}
end
if fence ~= ARGV[#ARGV] then
  return {-7}
end
for i = 2, last do
  if redis.call('GET', KEYS[i]) ~= ARGV[1] then
    return {0}
  end
end
-- A hold whose units a script already gave back (see confirm.lua) is not
-- extended: it would live on with its units free for others. Nor is one
-- whose holder's set no longer counts it (pruned by a master whose clock
-- ran ahead of the one now serving): it would live on outside the limit.
for j = 1, P do
  if not redis.call('ZSCORE', KEYS[pk + 2 * j - 1], ARGV[qa + j - 1] .. ':' .. ARGV[1]) then
    return {0}
  end
end
for h = 1, H do
  if not redis.call('ZSCORE', KEYS[hk + 2 * h - 2], ARGV[ua + h - 1] .. ':' .. ARGV[1]) then
    return {0}
  end
end
fence, created = tonumber(fence), tonumber(created)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
if now + ttl - created > tonumber(ARGV[3]) then
  return {-1, created, now}
end
-- As digits: a number handed to redis.call is printed with "%.17g".
local at = string.format('%d', now + ttl)
for i = 1, last do
  redis.call('PEXPIREAT', KEYS[i], at)
end
for j = 1, P do
  redis.call('ZADD', KEYS[pk + 2 * j - 1], 'XX', at, ARGV[qa + j - 1] .. ':' .. ARGV[1])
end
for h = 1, H do
  local holds = KEYS[hk + 2 * h - 2]
  redis.call('ZADD', holds, 'XX', at, ARGV[ua + h - 1] .. ':' .. ARGV[1])
  -- The holder's set lives as long as its last hold (see hold.lua).
  if redis.call('PEXPIREAT', holds, at, 'GT') == 0 then
    redis.call('PEXPIREAT', holds, at, 'NX')
  end
end
for i = 1, E do
  local items = ARGV[ia + i - 1]
  local entry = string.format('%s %d %s', ARGV[8], fence, items)
  if E == 1 then
    redis.call('ZADD', KEYS[ek], at, entry)
  else
    -- and the link to the next show's index (see hold.lua)
    redis.call('ZADD', KEYS[ek + 2 * i - 2], at, entry, at, ARGV[8] .. ' > ' .. KEYS[ek + 2 * (i % E)])
  end
  redis.call('XADD', KEYS[ek + 2 * i - 1], 'MAXLEN', '~', ARGV[7], '*',
    't', 'extended', 'r', ARGV[8], 's', items, 'f', fence, 'x', at)
end
if idem then
  local seats = string.match(record, '^%d+ %d+ (.*)$')
  redis.call('SET', idem, string.format('%s 200 %d %d %s', ARGV[4], fence, at, seats), 'PX', ARGV[5])
end
return {1, fence, ttl, now}
