-- pool.lua: read a pool, or create or resize it.
--
-- KEYS[1]  the pool's hash (`capacity`, `held`, `sold`)
-- KEYS[2]  the pool's holds: "<n>:<token>" scored with their expiry
-- KEYS[3]  the show's event stream (written only when resizing, events on)
-- ARGV[1]  the new capacity, or "" to read
-- ARGV[2]  approximate length cap of the stream ("" with events off)
-- ARGV[3]  the pool id, for the `pool_changed` event
--
-- Holds whose expiry has passed on Redis's clock give their units back
-- first, so `held` never counts an expired hold. A capacity below held +
-- sold is allowed: nothing is taken from existing holds, and no new hold is
-- granted until units come back.
--
-- A resize to the capacity the pool has already changes nothing and writes
-- no event, so a resend of this script (or a client's repeated PUT) writes
-- one `pool_changed` event, not two.
--
-- Returns {capacity, held, sold, written}, written 1 when a `pool_changed`
-- event was written, or {-1} when reading a pool that was never created.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- "(<now>" as digits: a Lua number would be printed with "%.14g" by
-- Lua, or "%.17g" by Redis (see hold.lua).
local below = string.format('(%d', now)
local gone = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', below)
if #gone > 0 then
  local units = 0
  for _, m in ipairs(gone) do units = units + (tonumber(string.match(m, '^(%d+):')) or 0) end
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', below)
  redis.call('HINCRBY', KEYS[1], 'held', -units)
end
local v = redis.call('HMGET', KEYS[1], 'capacity', 'held', 'sold')
local written = 0
if ARGV[1] ~= '' and v[1] ~= ARGV[1] then
  redis.call('HSET', KEYS[1], 'capacity', ARGV[1])
  v[1] = ARGV[1]
  if ARGV[2] ~= '' then
    redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[2], '*',
      't', 'pool_changed', 's', '@' .. ARGV[3] .. '=' .. ARGV[1])
    written = 1
  end
end
if not v[1] then
  return {-1}
end
return {tonumber(v[1]), tonumber(v[2]) or 0, tonumber(v[3]) or 0, written}
