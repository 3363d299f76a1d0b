-- modify.lua: change a hold's seats and pool units under the same token and
-- expiry, all or nothing, with a new fence and a `modified` event.
--
-- KEYS[1]                 hold record (its key names the token)
-- KEYS[2]                 the show's fence counter (read only with events off)
-- then K kept seat keys, R removed seat keys, A added seat keys
-- then per pool u = 1..U: the pool's hash and its holds (every pool the hold
--                         had or will have)
-- then, with a holder (H = 1): the show's settings, the holder's holds and
--                         bought units
-- then, with events (E = 1): the show's deadline index and event stream
-- KEYS[#KEYS]             idempotency record, only when ARGV[4] is not empty
-- ARGV[1]                 hold token
-- ARGV[2]                 the new record's kind and items ("s|alice 42/E9 42/@floor=3")
-- ARGV[3]                 the hold's public ref
-- ARGV[4]                 request fingerprint of an Idempotency-Key, or ""
-- ARGV[5]                 how long the idempotency record is kept, ms
-- ARGV[6 .. 9]            K, R, A, U
-- ARGV[10], ARGV[11]      H, and the holder limit when the settings name none
-- ARGV[12], ARGV[13]      E, and the approximate cap of the stream
-- ARGV[14], ARGV[15]      old and new items as events name them ("E7 @floor=2")
-- ARGV[16], ARGV[17]      old and new units of the hold (seats + pool units)
-- ARGV[18]                the fence of the record the change was computed from
-- then U pairs: the old and new quantity of pool u
--
-- The change was computed from the record the caller read (its fence is
-- ARGV[18]); when the record has changed since (a concurrent PATCH), nothing
-- changes and the answer is {-7}: the caller reads it again and recomputes,
-- so that no change is lost and the old seats, quantities and units given
-- here are the hold's. Every seat the hold keeps or gives back must still
-- carry the token, and every pool it had must still hold its units, or
-- nothing changes ({0}). Added seats are checked like
-- hold.lua's, pools with Redis's clock (expired holds give their units back
-- first), the holder limit on what the change adds. Returns {1, fence,
-- pttl_ms, now_ms}; {0}; {-7}; as hold.lua: {0, i, state, pttl, ...} for
-- taken added seats (i 1-based among the added), {-5, n, <n numbers of
-- taken seats as for 0>, j, requested, available, ...} for short pools, {-6, limit, current, requested}; {-3,
-- record, now_ms} when the idempotency record exists (the daemon runs every
-- change under a key, its own when the client sent none, so a resend of
-- this script after a lost reply finds the first run's record instead of
-- a changed hold).
local token = ARGV[1]
local K, R, A, U = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
local H, E = tonumber(ARGV[10]), tonumber(ARGV[12])
local ks, rs, as = 3, 3 + K, 3 + K + R
local pk = as + A
local hk = pk + 2 * U
local ek = hk + 3 * H
local idem = ARGV[4] ~= '' and KEYS[ek + 2 * E]

if idem then
  local done = redis.call('GET', idem)
  if done then
    local t = redis.call('TIME')
    return {-3, done, tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)}
  end
end
local record = redis.call('GET', KEYS[1])
local fence, created = string.match(record or '', '^(%d+) (%d+) ')
if not fence then return {0} end
if fence ~= ARGV[18] then return {-7} end
for i = ks, as - 1 do
  if redis.call('GET', KEYS[i]) ~= token then return {0} end
end
-- Units a script already gave back are not taken again (see confirm.lua):
-- a change that leaves a pool alone would add them back unchecked.
for u = 1, U do
  local old = ARGV[17 + 2 * u]
  if old ~= '0' and not redis.call('ZSCORE', KEYS[pk + 2 * u - 1], old .. ':' .. token) then
    return {0}
  end
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- The hold keeps its expiry, as digits: a number handed to redis.call is
-- printed with "%.17g" (see hold.lua).
local at = string.format('%d', redis.call('PEXPIRETIME', KEYS[1]))
-- The record was alive when the script began (Redis keeps a key alive for
-- the whole script), but TIME reads the clock, which may have passed the
-- expiry millisecond since: the change is dated no later than the expiry,
-- so that it answers no negative expiresInMs and prunes none of its own
-- pool units as expired.
now = math.min(now, tonumber(at))

-- Added seats must be free; taken ones are answered with the pools that
-- are short too, as hold.lua does, so the client learns all at once.
local taken = {0}
if A > 0 then
  local values = redis.call('MGET', unpack(KEYS, as, pk - 1))
  for i = 1, A do
    local v = values[i]
    if v then
      local state = 1
      if string.sub(v, 1, 5) == 'sold:' then state = 2 end
      taken[#taken + 1] = i
      taken[#taken + 1] = state
      taken[#taken + 1] = redis.call('PTTL', KEYS[as + i - 1])
    end
  end
end

local function prune(holds)
  local below = string.format('(%d', now) -- digits, not a Lua number's %.14g
  local gone = redis.call('ZRANGEBYSCORE', holds, '-inf', below)
  if #gone == 0 then return 0 end
  local units = 0
  for _, m in ipairs(gone) do units = units + (tonumber(string.match(m, '^(%d+):')) or 0) end
  redis.call('ZREMRANGEBYSCORE', holds, '-inf', below)
  return units
end

-- Pools that grow must have the units.
local short = {-5, 0}
for u = 1, U do
  local old, new = tonumber(ARGV[17 + 2 * u]), tonumber(ARGV[18 + 2 * u])
  local pool, holds = KEYS[pk + 2 * u - 2], KEYS[pk + 2 * u - 1]
  local back = prune(holds)
  if back > 0 then redis.call('HINCRBY', pool, 'held', -back) end
  if new > old then
    local v = redis.call('HMGET', pool, 'capacity', 'held', 'sold')
    local free = math.max((tonumber(v[1]) or 0) - (tonumber(v[2]) or 0) - (tonumber(v[3]) or 0), 0)
    if new - old > free then
      short[#short + 1] = u
      short[#short + 1] = new
      short[#short + 1] = free + old
    end
  end
end
if #short > 2 then
  if #taken > 1 then
    -- {-5, n, <n numbers of the taken seats' triples>, pools...}
    short[2] = #taken - 1
    for i = #taken, 2, -1 do table.insert(short, 3, taken[i]) end
  end
  return short
end
if #taken > 1 then return taken end

-- The holder limit counts what the change adds.
local old_units, new_units = tonumber(ARGV[16]), tonumber(ARGV[17])
if H == 1 and new_units > old_units then
  local limit = tonumber(redis.call('HGET', KEYS[hk], 'maxPerHolder') or ARGV[11]) or 0
  if limit > 0 then
    prune(KEYS[hk + 1])
    local current = tonumber(redis.call('GET', KEYS[hk + 2]) or '0') or 0
    for _, m in ipairs(redis.call('ZRANGE', KEYS[hk + 1], 0, -1)) do
      current = current + (tonumber(string.match(m, '^(%d+):')) or 0)
    end
    if current - old_units + new_units > limit then
      return {-6, limit, current, new_units - old_units}
    end
  end
end

-- Apply.
for i = as, pk - 1 do
  if not redis.call('SET', KEYS[i], token, 'NX', 'PXAT', at) then
    for j = as, i - 1 do redis.call('DEL', KEYS[j]) end
    return redis.error_reply('WRONGTYPE seat key ' .. KEYS[i] .. ' holds a value of another type')
  end
end
for i = rs, as - 1 do redis.call('DEL', KEYS[i]) end
for u = 1, U do
  local old, new = tonumber(ARGV[17 + 2 * u]), tonumber(ARGV[18 + 2 * u])
  local pool, holds = KEYS[pk + 2 * u - 2], KEYS[pk + 2 * u - 1]
  local had = old > 0 and redis.call('ZREM', holds, old .. ':' .. token) == 1
  local delta = new - (had and old or 0)
  if delta ~= 0 then redis.call('HINCRBY', pool, 'held', delta) end
  if new > 0 then redis.call('ZADD', holds, at, new .. ':' .. token) end
end
if H == 1 then
  redis.call('ZREM', KEYS[hk + 1], old_units .. ':' .. token)
  redis.call('ZADD', KEYS[hk + 1], at, new_units .. ':' .. token)
  -- The holder's set lives as long as its last hold (see hold.lua).
  if redis.call('PEXPIREAT', KEYS[hk + 1], at, 'GT') == 0 then
    redis.call('PEXPIREAT', KEYS[hk + 1], at, 'NX')
  end
end

local new_fence
if E == 1 then
  local stream = KEYS[ek + 1]
  local id = redis.call('XADD', stream, 'MAXLEN', '~', ARGV[13], '*',
    't', 'modified', 'r', ARGV[3], 's', ARGV[15], 'x', at)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  ms, seq = tonumber(ms), tonumber(seq)
  -- As in hold.lua: past 999 events in one millisecond (or on a clock that
  -- went back, when ids carry on from the last one), ms x 1000 + sequence
  -- would reach the next millisecond's fences; move to the next ms.
  if seq > 999 then
    redis.call('XDEL', stream, id)
    -- counted for events.lua (see hold.lua's xdel)
    redis.call('INCRBY', stream .. '-deleted', 1)
    ms, seq = ms + 1, 0
    redis.call('XADD', stream, ms .. '-0', 't', 'modified', 'r', ARGV[3], 's', ARGV[15], 'x', at)
  end
  new_fence = ms * 1000 + seq
  redis.call('ZREM', KEYS[ek], ARGV[3] .. ' ' .. fence .. ' ' .. ARGV[14])
  redis.call('ZADD', KEYS[ek], at, string.format('%s %d %s', ARGV[3], new_fence, ARGV[15]))
else
  new_fence = math.max(now * 1000, (tonumber(redis.call('GET', KEYS[2]) or '0') or 0) + 1, tonumber(fence) + 1)
  redis.call('SET', KEYS[2], string.format('%d', new_fence))
end
redis.call('SET', KEYS[1], string.format('%d %s %s', new_fence, created, ARGV[2]), 'KEEPTTL')
if idem then
  redis.call('SET', idem, string.format('%s 200 %d %d %s', ARGV[4], new_fence, at, ARGV[2]), 'PX', ARGV[5])
end
return {1, new_fence, at - now, now}
