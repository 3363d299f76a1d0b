-- hold.lua: hold every seat under one token, all or nothing, and write the
-- `held` event of every involved show in the same step.
--
-- KEYS[1]                  hold record to create (a string), under the home show
-- KEYS[2 .. 1+F]           fence counter of every show (only with events off)
-- KEYS[2+F .. 1+F+S]       seat keys, in request order
-- KEYS[2+F+S ..]           per involved show i = 1..E: its deadline index
--                          (a sorted set) and its event stream
-- KEYS[#KEYS]              idempotency record, only when ARGV[6] is not empty
-- ARGV[1]                  hold token (a fresh UUID v4)
-- ARGV[2]                  TTL in milliseconds
-- ARGV[3]                  F, the number of fence keys (0 with events on)
-- ARGV[4]                  kind: "s" (one show's route) or "m" (POST /v1/holds)
-- ARGV[5]                  seats as "show/seat" joined with spaces, request order
-- ARGV[6]                  request fingerprint of an Idempotency-Key, or ""
-- ARGV[7]                  how long the idempotency record is kept, ms
-- ARGV[8]                  E, the number of involved shows with events on (0: off)
-- ARGV[9]                  approximate length cap of each event stream
-- ARGV[10]                 the hold's public ref (16 hex digits of SHA-256(token))
-- ARGV[11 .. 10+E]         show i's seat ids, joined with spaces
--
-- The record is "<fence> <created_ms> <kind> <seats>" with the hold's
-- expiry; the token is in its key. Every call below costs the master (Lua's
-- redis.call is several times dearer than the command it runs), so the
-- script makes as few as the contract allows. With events on, one seat
-- costs SET NX PX, XADD, SET NX of the record and ZADD: the event's stream
-- id carries Redis's time (the hold's creation) and a per-show increasing
-- number, so it also gives the fence (ms x 1000 + sequence), and no fence
-- counter is kept. With events off, the fence counter is read and written:
-- SET NX PX, PEXPIRETIME, GET and SET of the fence, SET NX of the record.
--
-- A fence exceeds every earlier fence of each involved show and is at least
-- Redis's time in ms x 1000, so a failover that loses the last writes cannot
-- make a fence repeat, as long as the new master's clock is not behind by
-- more than the promotion took.
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
-- The deadline index of each show gets "<ref> <fence> <seats>" scored with
-- the hold's expiry: sweep.lua turns it into the `expired` event once.
--
-- Returns {1, fence, pttl_ms, now_ms} when every seat was free and is now
-- held, or when they are already held under this very token (a resend: see
-- already_held); {-3, record} when the idempotency record exists (the caller
-- answers from it); {-4} when the hold was abandoned before it ran;
-- otherwise {0, i, state, pttl_ms, ...} for every taken seat (i is its
-- 1-based position in the request, state 1 = held, 2 = sold) and writes
-- nothing. Taken seats are a normal answer, not an error.
local token, ttl = ARGV[1], tonumber(ARGV[2])
local fences, shows = tonumber(ARGV[3]), tonumber(ARGV[8])
local idem = ARGV[6] ~= '' and KEYS[#KEYS]
local first = 2 + fences
local last = #KEYS - 2 * shows - (idem and 1 or 0)

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

-- Deletes the seats first .. upto, which this run wrote.
local function undo(upto)
  for i = first, upto do redis.call('DEL', KEYS[i]) end
end

local function foreign(i)
  return redis.error_reply('WRONGTYPE seat key ' .. KEYS[i] .. ' holds a value of another type')
end

-- Writes the `held` event of every show; answers the stream ids and the
-- time and fence they give. Several shows get one id, the largest, so that
-- every show's later ids (and fences) exceed this hold's.
local function add_events()
  local ids, top = {}, nil
  for i = 1, shows do
    local stream = KEYS[last + 2 * i]
    local id = redis.call('XADD', stream, 'MAXLEN', '~', ARGV[9], '*',
      't', 'held', 'r', ARGV[10], 's', ARGV[10 + i], 'l', ttl)
    local ms, seq = string.match(id, '^(%d+)-(%d+)$')
    ms, seq = tonumber(ms), tonumber(seq)
    -- More than 999 events of one show in one millisecond (or a clock that
    -- went back) would break ms x 1000 + sequence: move to the next ms.
    if seq > 999 then
      redis.call('XDEL', stream, id)
      ms, seq = ms + 1, 0
      id = redis.call('XADD', stream, ms .. '-0', 't', 'held', 'r', ARGV[10], 's', ARGV[10 + i], 'l', ttl)
    end
    ids[i] = {stream, id, ms, seq}
    if not top or ms > top[3] or (ms == top[3] and seq > top[4]) then top = ids[i] end
  end
  for i = 1, shows do
    local e = ids[i]
    if e[2] ~= top[2] then
      redis.call('XDEL', e[1], e[2])
      redis.call('XADD', e[1], top[2], 't', 'held', 'r', ARGV[10], 's', ARGV[10 + i], 'l', ttl)
      e[2] = top[2]
    end
  end
  return ids, top[3], top[3] * 1000 + top[4]
end

if last == first then
  -- One seat: SET NX checks and takes it in one call.
  if not redis.call('SET', KEYS[first], token, 'NX', 'PX', ttl) then
    local v = redis.call('GET', KEYS[first]) or ''
    local again = v == token and already_held()
    if again then return again end
    return {0, taken_seat(first, v)}
  end
else
  local taken = {0}
  local values = redis.call('MGET', unpack(KEYS, first, last))
  -- Holds are written whole, so the first seat tells whether this is a
  -- resend of a hold that is already in place.
  if values[1] == token then
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
  if not redis.call('SET', KEYS[first], token, 'NX', 'PX', ttl) then
    return foreign(first)
  end
end

-- The hold's time on Redis's clock: from the event's stream id, or (events
-- off) from the first seat's expiry. It dates the hold (created = now, for
-- the lifetime cap) and gives every other key exactly the same expiry.
local ids, now, fence
if shows > 0 then
  ids, now, fence = add_events()
else
  now = redis.call('PEXPIRETIME', KEYS[first]) - ttl
  fence = now * 1000
  for i = 2, first - 1 do
    local f = tonumber(redis.call('GET', KEYS[i]) or '0') or 0
    if f >= fence then fence = f + 1 end
  end
end
local at = now + ttl

local function undo_all(upto)
  undo(upto)
  for i = 1, shows do redis.call('XDEL', ids[i][1], ids[i][2]) end
end

for i = first + 1, last do
  if not redis.call('SET', KEYS[i], token, 'NX', 'PXAT', at) then
    undo_all(i - 1)
    return foreign(i)
  end
end

local record = string.format('%d %d %s %s', fence, now, ARGV[4], ARGV[5])
if not redis.call('SET', KEYS[1], record, 'NX', 'PXAT', at) then
  undo_all(last)
  return {-4}
end
for i = 2, first - 1 do
  redis.call('SET', KEYS[i], string.format('%d', fence))
end
for i = 1, shows do
  redis.call('ZADD', KEYS[last + 2 * i - 1], at, string.format('%s %d %s', ARGV[10], fence, ARGV[10 + i]))
end
if idem then
  redis.call('SET', idem, string.format('%s 201 %s %d %d', ARGV[6], token, fence, at), 'PX', ARGV[7])
end
return {1, fence, ttl, now}
