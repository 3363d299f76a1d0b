-- hold.lua: hold every seat under one token, all or nothing.
--
-- KEYS[1]              hold record to create (a string), under the home show
-- KEYS[2 .. 1+F]       fence counter of every distinct show of the hold
-- KEYS[2+F .. S]       seat keys, in request order
-- KEYS[S+1]            idempotency record, only when ARGV[6] is not empty
-- ARGV[1]              hold token (a fresh UUID v4)
-- ARGV[2]              TTL in milliseconds
-- ARGV[3]              F, the number of fence keys
-- ARGV[4]              kind: "s" (one show's route) or "m" (POST /v1/holds)
-- ARGV[5]              seats as "show/seat" joined with spaces, request order
-- ARGV[6]              request fingerprint of an Idempotency-Key, or ""
-- ARGV[7]              how long the idempotency record is kept, ms
--
-- The record is "<fence> <created_ms> <kind> <seats>" with the hold's
-- expiry; the token is in its key. One string rather than a hash: one write
-- (SET with PXAT) instead of HSET plus PEXPIRE, for the master and every
-- replica. Every call below costs the master (Lua's redis.call is several
-- times dearer than the command it runs), so the script makes as few as the
-- contract allows: for one seat SET NX PX, PEXPIRETIME, GET and SET of the
-- fence, and SET NX of the record.
--
-- A single seat is checked and taken by one SET NX PX, as the reference
-- design does; several are all checked with one MGET before any is written.
-- Seats are written with NX even after the MGET: MGET reads a key of another
-- type as empty, and a key that is not ours is never overwritten.
--
-- The record is written with NX: a record key that exists already is the
-- tombstone that abandon.lua leaves for a hold whose request was answered
-- 503 (the script arrived late). Then nothing of this hold stays written.
--
-- Returns {1, fence, pttl_ms, now_ms} when every seat was free and is now
-- held (pttl_ms is the remaining time Redis gave the keys, now_ms Redis's
-- clock when it did), or when they are already held under this very token
-- (a resend: see already_held); {-3, record} when the idempotency record
-- exists (the caller answers from it); {-4} when the hold was abandoned
-- before it ran; otherwise {0, i, state, pttl_ms, ...} for every taken seat
-- (i is its 1-based position in the request, state 1 = held, 2 = sold) and
-- writes nothing. Taken seats are a normal answer, not an error.
local fences = tonumber(ARGV[3])
local first = 2 + fences
local idem = ARGV[6] ~= '' and KEYS[#KEYS]
local last = idem and #KEYS - 1 or #KEYS

if idem then
  local done = redis.call('GET', idem)
  if done then return {-3, done} end
end

-- The answer to a resend of this very hold: the same token already holds
-- every seat (the first run's reply was lost with its connection, and the
-- request went again), so answer as the first run did, from its record,
-- instead of reporting the seats taken by their own holder. Nothing is
-- written. nil if there is no record (then the seats are not this hold's).
local function already_held()
  local record = redis.call('GET', KEYS[1])
  local fence = record and string.match(record, '^(%d+) ')
  if not fence then return nil end
  local pttl = redis.call('PTTL', KEYS[1])
  return {1, tonumber(fence), pttl, redis.call('PEXPIRETIME', KEYS[1]) - pttl}
end

-- The state of a seat that is taken: {i, state, pttl_ms}.
local function taken_seat(i, v)
  local state = 1
  if string.sub(v, 1, 5) == 'sold:' then state = 2 end
  return i - first + 1, state, redis.call('PTTL', KEYS[i])
end

-- Deletes the seats this run wrote, first .. upto.
local function undo(upto)
  for i = first, upto do redis.call('DEL', KEYS[i]) end
end

if last == first then
  -- One seat: SET NX checks and takes it in one call.
  if not redis.call('SET', KEYS[first], ARGV[1], 'NX', 'PX', ARGV[2]) then
    local v = redis.call('GET', KEYS[first]) or ''
    local again = v == ARGV[1] and already_held()
    if again then return again end
    return {0, taken_seat(first, v)}
  end
else
  local taken = {0}
  local values = redis.call('MGET', unpack(KEYS, first, last))
  -- Holds are written whole, so the first seat tells whether this is a
  -- resend of a hold that is already in place.
  if values[1] == ARGV[1] then
    local again = already_held()
    if again then return again end
  end
  for i = first, last do
    local v = values[i - first + 1]
    if v then
      local n, state, pttl = taken_seat(i, v)
      taken[#taken + 1] = n
      taken[#taken + 1] = state
      taken[#taken + 1] = pttl
    end
  end
  if #taken > 1 then
    return taken
  end
  if not redis.call('SET', KEYS[first], ARGV[1], 'NX', 'PX', ARGV[2]) then
    return redis.error_reply('WRONGTYPE seat key ' .. KEYS[first] .. ' holds a value of another type')
  end
end

-- The hold's expiry, as an absolute time on Redis's own clock: it dates the
-- hold (created = expiry - TTL, for the lifetime cap) and answers its
-- remaining time, one call instead of TIME plus PTTL. The other seats and
-- the record get exactly the same expiry.
local ttl = tonumber(ARGV[2])
local at = redis.call('PEXPIRETIME', KEYS[first])
local now = at - ttl
for i = first + 1, last do
  if not redis.call('SET', KEYS[i], ARGV[1], 'NX', 'PXAT', at) then
    undo(i - 1)
    return redis.error_reply('WRONGTYPE seat key ' .. KEYS[i] .. ' holds a value of another type')
  end
end

-- The new fence exceeds every involved show's last one, so that each show's
-- counter keeps increasing strictly, and is at least Redis's time in
-- microseconds-like units (ms x 1000): a failover that loses the last
-- increments cannot make a fence repeat, as long as the new master's clock
-- is not behind by more than the time the promotion took.
local fence = now * 1000
for i = 2, first - 1 do
  local f = tonumber(redis.call('GET', KEYS[i]) or '0') or 0
  if f >= fence then fence = f + 1 end
end

local record = string.format('%d %d %s %s', fence, now, ARGV[4], ARGV[5])
if not redis.call('SET', KEYS[1], record, 'NX', 'PXAT', at) then
  undo(last)
  return {-4}
end
for i = 2, first - 1 do
  redis.call('SET', KEYS[i], string.format('%d', fence))
end
if idem then
  redis.call('SET', idem, string.format('%s 201 %s %d %d', ARGV[6], ARGV[1], fence, at), 'PX', ARGV[7])
end
return {1, fence, at - now, now}
