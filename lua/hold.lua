-- hold.lua: hold seats and pool units under one token, all or nothing, and
-- write the `held` event of every involved show in the same step.
--
-- KEYS[1]                  hold record to create (a string), under the home show
-- KEYS[2 .. 1+F]           fence counter of every show (only with events off)
-- then S seat keys, in request order
-- then per pool j = 1..P:  the pool's hash and its holds (a sorted set)
-- then per show h = 1..H:  its settings, the holder's holds, the holder's
--                          bought units (H = 0 without a holder)
-- then per show i = 1..E:  its deadline index and its event stream
-- KEYS[#KEYS]              idempotency record, only when ARGV[6] is not empty
-- ARGV[1]                  hold token (a fresh UUID v4)
-- ARGV[2]                  TTL in milliseconds
-- ARGV[3]                  F, the number of fence keys (0 with events on)
-- ARGV[4]                  kind: "s" (one show's route) or "m" (POST /v1/holds),
--                          and "|<holder>" when the hold names one
-- ARGV[5]                  items as "show/seat" and "show/@pool=n", request order
-- ARGV[6]                  request fingerprint of an Idempotency-Key, or ""
-- ARGV[7]                  how long the idempotency record is kept, ms
-- ARGV[8]                  E, the number of involved shows with events on (0: off)
-- ARGV[9]                  approximate length cap of each event stream
-- ARGV[10]                 the hold's public ref (16 hex digits of SHA-256(token))
-- ARGV[11], ARGV[12]       S and P
-- ARGV[13]                 H
-- ARGV[14]                 the holder limit when a show's settings have none (0: none)
-- then E items of show i ("E7 @floor=2"), P quantities, H units of show h
-- A hold of one seat without pools or holder comes in a short form of 7
-- (or 9) arguments instead, described where it runs, below.
--
-- The record is "<fence> <created_ms> <kind> <items>" with the hold's
-- expiry; the token is in its key. Every call below costs the master (Lua's
-- redis.call is several times dearer than the command it runs), so the
-- script makes as few as the contract allows. With events on, one seat
-- costs SET NX PX, PEXPIRETIME, XADD, SET NX of the record and ZADD: the
-- event's stream id carries a per-show increasing number and is at least
-- Redis's time, so it gives the fence (ms x 1000 + sequence), and no fence
-- counter is kept. The hold's time comes from the seat's expiry, not from
-- the id, which runs ahead of Redis's clock after a failover to a master
-- whose clock is behind (the fences must go on rising), or when a
-- millisecond has more than 999 events: dated by the id, the seat would
-- come free before its record and deadline (PEXPIRETIME costs the master
-- 6.7k of the 103k instructions of such a hold, callgrind,
-- cluster/bench/lua-cost.sh). With events off, the fence counter is read
-- and written: SET NX PX, PEXPIRETIME, GET and SET of the fence, SET NX of
-- the record.
--
-- A fence exceeds every earlier fence of each involved show and is at least
-- Redis's time in ms x 1000, so a failover that loses the last writes cannot
-- make a fence repeat, as long as the new master's clock is not behind by
-- more than the promotion took.
--
-- A single seat is checked and taken by one SET NX PX, as the reference
-- design does; several seats, or seats with pool units or a holder, are all
-- checked before anything is written. Seats are written with NX even after
-- the MGET: MGET reads a key of another type as empty, and a key that is
-- not ours is never overwritten.
--
-- Pools: a pool's hash keeps `capacity`, `held` and `sold`; its holds are
-- "<n>:<token>" scored with their expiry. Every script that reads a pool
-- first removes the holds whose expiry has passed on Redis's clock and gives
-- their units back, so availability never counts an expired hold, whether or
-- not its `expired` event was written yet. A holder's live holds are kept
-- the same way, in a set that expires with the last of them, and what it
-- bought in a counter: the limit counts both.
--
-- The record is written with NX: a record key that exists already is the
-- tombstone that abandon.lua leaves for a hold whose request was answered
-- 503 (the script arrived late). Then nothing of this hold stays written.
--
-- Returns {1, fence, pttl_ms, now_ms} when everything was free and is now
-- held, or when the seats are already held under this very token (a
-- resend: see already_held); {-3, record} when the idempotency record
-- exists (the caller answers from it); {-4} when the hold was abandoned
-- before it ran; {0, i, state, pttl_ms, ...} for every taken seat (i is its
-- 1-based position among the seats, state 1 = held, 2 = sold);
-- {-5, n, <n seat numbers as for 0>, j, requested, available, ...} when a
-- pool is short (and maybe seats taken); {-6, limit, current, requested}
-- past the holder limit. Only the first answer writes anything.

-- One seat and nothing else, the hold an on-sale is made of, has a short
-- form of its own, with 7 arguments instead of 15 (9 with an idempotency
-- key):
--   KEYS    events on: record, seat, deadline index, stream[, idempotency]
--           events off: record, fence counter, seat[, idempotency]
--   ARGV[1] token, ARGV[2] TTL in ms, ARGV[3] '1' events on / '0' off,
--   ARGV[4] "<kind> <items>" (the record's tail), ARGV[5] the hold's ref,
--   ARGV[6] the seat, ARGV[7] the stream's length cap,
--   [ARGV[8] the request's fingerprint, ARGV[9] how long its record is kept]
-- Every argument costs the master about 700 instructions (Redis parses it,
-- and the script's ARGV table interns it as a Lua string, which the Lua
-- garbage collector later frees), whatever the script does with it: 7.2k
-- of the 15-argument form's 104k per events-on hold (callgrind). It makes
-- the same calls and gives the same answers as the general form below.
-- It reads its arguments as strings and hands Redis its times as digits,
-- because Lua's numbers cost the master instructions: every tonumber is a
-- strtod, and every number passed to redis.call is printed with "%.17g"
-- (glibc's floating-point printf: 3,700 instructions more than the same
-- digits as a string, by callgrind, in a script of one SET). The general
-- form's helpers (their closures, tables and string.format) are never
-- defined on this path either.
if #ARGV < 14 then
  local on = ARGV[3] == '1'
  local token, ttl, seat = ARGV[1], ARGV[2], on and KEYS[2] or KEYS[3]
  local idem = ARGV[8] and KEYS[on and 5 or 4]
  local done = idem and redis.call('GET', idem)
  if done then return {-3, done} end
  if redis.call('SET', seat, token, 'NX', 'PX', ttl) then
    -- The hold's expiry is the seat's, on Redis's clock; the event's id
    -- may run ahead of that clock (after a failover to a master whose
    -- clock is behind, or with more than 999 events in a millisecond), and
    -- gives only the fence. Fence, created and expiry as digits.
    local expiry = redis.call('PEXPIRETIME', seat)
    local at = string.format('%d', expiry)
    local created = string.format('%d', expiry - ttl)
    local fence, stream, id
    if on then
      stream = KEYS[4]
      id = redis.call('XADD', stream, 'MAXLEN', '~', ARGV[7], '*',
        't', 'held', 'r', ARGV[5], 's', ARGV[6], 'x', at)
      local ms, seq = string.match(id, '^(%d+)-(%d+)$')
      if #seq > 3 then
        -- as in add_events below: the next millisecond, sequence 0
        redis.call('XDEL', stream, id)
        redis.call('INCRBY', stream .. '-deleted', 1)
        ms, seq = string.format('%d', ms + 1), '0'
        id = redis.call('XADD', stream, ms .. '-0', 't', 'held', 'r', ARGV[5], 's', ARGV[6], 'x', at)
      end
      -- ms x 1000 + seq, written as digits: no arithmetic on 16 digits
      fence = ms .. string.rep('0', 3 - #seq) .. seq
    else
      local f = tonumber(redis.call('GET', KEYS[2]) or '0') or 0
      fence = string.format('%d', math.max((expiry - ttl) * 1000, f + 1))
    end
    if not redis.call('SET', KEYS[1], fence .. ' ' .. created .. ' ' .. ARGV[4], 'NX', 'PXAT', at) then
      redis.call('DEL', seat)
      if id then
        redis.call('XDEL', stream, id)
        redis.call('INCRBY', stream .. '-deleted', 1)
      end
      return {-4}
    end
    if on then
      redis.call('ZADD', KEYS[3], at, ARGV[5] .. ' ' .. fence .. ' ' .. ARGV[6])
    else
      redis.call('SET', KEYS[2], fence)
    end
    if idem then
      redis.call('SET', idem, ARGV[8] .. ' 201 ' .. token .. ' ' .. fence .. ' ' .. at, 'PX', ARGV[9])
    end
    -- digits, which the daemon reads as integers
    return {1, fence, ttl, created}
  end
  local v = redis.call('GET', seat) or ''
  if v == token then
    -- a resend: answer as the first run did (already_held below)
    local record = redis.call('GET', KEYS[1])
    local fence = record and string.match(record, '^(%d+) ')
    if fence then
      local pttl = redis.call('PTTL', KEYS[1])
      return {1, fence, pttl, redis.call('PEXPIRETIME', KEYS[1]) - pttl}
    end
  end
  local state = 1
  if string.sub(v, 1, 5) == 'sold:' then state = 2 end
  return {0, 1, state, redis.call('PTTL', seat)}
end

-- ttl is a number for arithmetic; Redis gets ARGV[2], the same digits,
-- which need no printing (see the comment above).
local token, ttl = ARGV[1], tonumber(ARGV[2])

-- Deletes an entry this run wrote to `stream`, and counts it in the
-- stream's `-deleted` counter: events.lua tells a trimmed stream (entries
-- a reader may have missed) from one that lost only such entries by it.
local function xdel(stream, id)
  redis.call('XDEL', stream, id)
  redis.call('INCRBY', stream .. '-deleted', 1)
end
local F, E = tonumber(ARGV[3]), tonumber(ARGV[8])
local S, P, H = tonumber(ARGV[11]), tonumber(ARGV[12]), tonumber(ARGV[13])
local first = 2 + F
local last = first + S - 1
local pk = last + 1
local hk = pk + 2 * P
local ek = hk + 3 * H
local idem = ARGV[6] ~= '' and KEYS[ek + 2 * E]
local ia, qa = 15, 15 + E
local ua = qa + P

if idem then
  local done = redis.call('GET', idem)
  if done then return {-3, done} end
end

-- The answer to a resend of this very hold: the same token already holds
-- every seat, or for a hold of pool units only its record exists (the
-- first run's reply was lost with its connection, and the request went
-- again), so answer as the first run did, from its record, instead of
-- reporting the seats taken by their own holder or counting the units
-- twice. Nothing is written. nil if there is no record (then the seats are
-- not this hold's).
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

-- Removes the entries of a holds set (`<n>:<token>`) that expired before
-- `now`; answers the units they held. Strictly before: Redis keeps a key
-- through its expiry millisecond, and so does a hold (an extend in that
-- millisecond still finds it), so its units count until then.
local function prune(holds, now)
  local below = string.format('(%d', now) -- digits, not a Lua number's %.14g
  local gone = redis.call('ZRANGEBYSCORE', holds, '-inf', below)
  if #gone == 0 then return 0 end
  local units = 0
  for _, m in ipairs(gone) do units = units + (tonumber(string.match(m, '^(%d+):')) or 0) end
  redis.call('ZREMRANGEBYSCORE', holds, '-inf', below)
  return units
end

-- Units a pool can still give, after giving back what expired.
local function available(j, now)
  local pool, holds = KEYS[pk + 2 * j - 2], KEYS[pk + 2 * j - 1]
  local back = prune(holds, now)
  if back > 0 then redis.call('HINCRBY', pool, 'held', -back) end
  local v = redis.call('HMGET', pool, 'capacity', 'held', 'sold')
  local capacity = tonumber(v[1])
  if not capacity then return 0 end
  return math.max(capacity - (tonumber(v[2]) or 0) - (tonumber(v[3]) or 0), 0)
end

-- {limit, current} of the holder in show h; limit 0 means none. Either
-- way its holds that expired leave its set, which otherwise only grows
-- while the holder always has a live hold (a box office, a reseller).
local function holder_count(h, now)
  local settings, holds, bought = KEYS[hk + 3 * h - 3], KEYS[hk + 3 * h - 2], KEYS[hk + 3 * h - 1]
  local limit = tonumber(redis.call('HGET', settings, 'maxPerHolder') or ARGV[14]) or 0
  if limit == 0 then
    redis.call('ZREMRANGEBYSCORE', holds, '-inf', string.format('(%d', now))
    return 0, 0
  end
  prune(holds, now)
  local current = tonumber(redis.call('GET', bought) or '0') or 0
  for _, m in ipairs(redis.call('ZRANGE', holds, 0, -1)) do
    current = current + (tonumber(string.match(m, '^(%d+):')) or 0)
  end
  return limit, current
end

-- Writes the `held` event of every show; answers the stream ids and the
-- fence they give. Several shows get one id, the largest, so that every
-- show's later ids (and fences) exceed this hold's. `expiry`: the hold's
-- expiry on Redis's clock (from TIME, or the first seat's), which the
-- event carries (`x`): the id's time may be a millisecond or more later,
-- and that time plus the TTL would not be the hold's.
local function add_events(expiry)
  local ids, top = {}, nil
  local function fields(i)
    return 't', 'held', 'r', ARGV[10], 's', ARGV[ia + i - 1], 'x', expiry
  end
  for i = 1, E do
    local stream = KEYS[ek + 2 * i - 1]
    local id = redis.call('XADD', stream, 'MAXLEN', '~', ARGV[9], '*', fields(i))
    local ms, seq = string.match(id, '^(%d+)-(%d+)$')
    ms, seq = tonumber(ms), tonumber(seq)
    -- More than 999 events of one show in one millisecond (or a clock that
    -- went back) would break ms x 1000 + sequence: move to the next ms.
    if seq > 999 then
      xdel(stream, id)
      ms, seq = ms + 1, 0
      id = redis.call('XADD', stream, ms .. '-0', fields(i))
    end
    ids[i] = {stream, id, ms, seq}
    if not top or ms > top[3] or (ms == top[3] and seq > top[4]) then top = ids[i] end
  end
  for i = 1, E do
    local e = ids[i]
    if e[2] ~= top[2] then
      xdel(e[1], e[2])
      redis.call('XADD', e[1], top[2], fields(i))
      e[2] = top[2]
    end
  end
  return ids, top[3] * 1000 + top[4]
end

-- Checks. `now` is Redis's time when pools or a holder need it.
local now
if S == 1 and P == 0 and H == 0 then
  -- One seat: SET NX checks and takes it in one call.
  if not redis.call('SET', KEYS[first], token, 'NX', 'PX', ARGV[2]) then
    local v = redis.call('GET', KEYS[first]) or ''
    local again = v == token and already_held()
    if again then return again end
    return {0, taken_seat(first, v)}
  end
else
  local taken = {}
  if S > 0 then
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
  end
  if S == 0 then
    -- No seat to tell a resend by: the record does (only this token's
    -- first run writes it; an abandoned hold's tombstone has no fence).
    local again = already_held()
    if again then return again end
  end
  local short = {}
  if P > 0 or H > 0 then
    local t = redis.call('TIME')
    now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  for j = 1, P do
    local want, have = tonumber(ARGV[qa + j - 1]), available(j, now)
    if want > have then
      short[#short + 1] = j
      short[#short + 1] = want
      short[#short + 1] = have
    end
  end
  if #short > 0 then
    local reply = {-5, #taken}
    for _, v in ipairs(taken) do reply[#reply + 1] = v end
    for _, v in ipairs(short) do reply[#reply + 1] = v end
    return reply
  end
  if #taken > 0 then
    table.insert(taken, 1, 0)
    return taken
  end
  for h = 1, H do
    local want = tonumber(ARGV[ua + h - 1])
    local limit, current = holder_count(h, now)
    if limit > 0 and current + want > limit then
      return {-6, limit, current, want}
    end
  end
  if S > 0 then
    local taken_first
    if now then
      taken_first = redis.call('SET', KEYS[first], token, 'NX', 'PXAT', string.format('%d', now + ttl))
    else
      taken_first = redis.call('SET', KEYS[first], token, 'NX', 'PX', ARGV[2])
    end
    if not taken_first then return foreign(first) end
  end
end

-- The hold's time on Redis's clock: from TIME (pools, holder) or the
-- first seat's expiry, never the event's stream id, which may run ahead of
-- that clock (see the short form above). It dates the hold (created = now,
-- for the lifetime cap) and gives every key one expiry. A hold has seats
-- or pool units (the daemon refuses an empty one), and pool units read
-- TIME above.
local ids, fence
if not now then
  now = redis.call('PEXPIRETIME', KEYS[first]) - ttl
end
if E > 0 then
  ids, fence = add_events(string.format('%d', now + ttl))
else
  fence = now * 1000
  for i = 2, first - 1 do
    local f = tonumber(redis.call('GET', KEYS[i]) or '0') or 0
    if f >= fence then fence = f + 1 end
  end
end
-- As digits: a number handed to redis.call is printed with "%.17g".
local at = string.format('%d', now + ttl)

local function undo_all(upto)
  undo(upto)
  for i = 1, E do xdel(ids[i][1], ids[i][2]) end
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
for j = 1, P do
  local q = ARGV[qa + j - 1]
  redis.call('HINCRBY', KEYS[pk + 2 * j - 2], 'held', q)
  redis.call('ZADD', KEYS[pk + 2 * j - 1], at, q .. ':' .. token)
end
for h = 1, H do
  local holds = KEYS[hk + 3 * h - 2]
  redis.call('ZADD', holds, at, ARGV[ua + h - 1] .. ':' .. token)
  -- The set lives as long as its last hold, so that a holder who never
  -- comes back leaves nothing behind (its entries are pruned only when it
  -- holds again): GT raises an expiry, NX gives a new set its first (GT
  -- counts a key without one as never expiring).
  if redis.call('PEXPIREAT', holds, at, 'GT') == 0 then
    redis.call('PEXPIREAT', holds, at, 'NX')
  end
end
for i = 2, first - 1 do
  redis.call('SET', KEYS[i], string.format('%d', fence))
end
for i = 1, E do
  local entry = string.format('%s %d %s', ARGV[10], fence, ARGV[ia + i - 1])
  if E == 1 then
    redis.call('ZADD', KEYS[ek], at, entry)
  else
    -- Several shows: each index also links the hold to the next show's
    -- index ("<ref> > <key>"), so that a sweep of any of them wakes the
    -- next (sweep.lua). Another instance hears only the home show's record
    -- expire; without the links the other shows waited for a scan. The
    -- daemon names the shows in id order, so only the last show's link
    -- names a lower id: sweep.lua counts the hold's expiry there alone.
    redis.call('ZADD', KEYS[ek + 2 * i - 2], at, entry, at, ARGV[10] .. ' > ' .. KEYS[ek + 2 * (i % E)])
  end
end
if idem then
  redis.call('SET', idem, string.format('%s 201 %s %d %d', ARGV[6], token, fence, at), 'PX', ARGV[7])
end
return {1, fence, ttl, now}
