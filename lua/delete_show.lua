-- delete_show.lua: delete one batch of a show's keys for `seathold
-- delete-show`, unless a hold made since the command's check is live.
--
-- KEYS[1 .. N]      the batch: keys of one show, as CLUSTER GETKEYSINSLOT
--                   listed them
-- KEYS[N+1 ..]      guards: sorted sets of holds scored with their expiry
--                   (the show's deadline index, the holds of each pool
--                   whose hash is in the batch), whether or not they exist
-- ARGV[1]           N
-- ARGV[2]           '1': check first; '0' (--force): delete regardless
-- ARGV[3]           length of the show's key tag `<prefix>{show:<show>}`
-- ARGV[4]           the value prefix of a sold seat
--
-- The command refuses a show with a live hold before it deletes anything,
-- but a hold can be made between that check and the deletion. This script
-- checks again, with Redis's clock, in the same step as the deletion: it
-- deletes nothing of its batch when one of these is live:
--   a seat whose value is a token (not sold);
--   a hold record that is not an abandoned hold's tombstone;
--   a pool's or holder's holds with an expiry still ahead;
--   a guard with an expiry ahead, or the deadline index with a hold whose
--   `expired` event is due but not written (an entry that is not a link
--   "<ref> > <key>" of a hold of several shows).
-- A hold made after the check writes a new deadline entry (events on) or
-- a seat key that exists already (one the check listed after its hold
-- ran out), or takes units of a pool: one of those is then seen. A hold
-- whose keys are all new survives anyway, since only listed keys go.
--
-- Returns {1, deleted} or {0, the first live key}.

local n = tonumber(ARGV[1])
if ARGV[2] == '1' then
  local t = redis.call('TIME')
  local now = t[1] * 1000 + math.floor(t[2] / 1000)
  local tag, sold = tonumber(ARGV[3]), ARGV[4]
  local strings = {}
  local function live_set(key, from)
    return redis.call('ZCOUNT', key, from, '+inf') > 0
  end
  for i = 1, n do
    local key = KEYS[i]
    local rest = string.sub(key, tag + 1)
    if string.sub(rest, 1, 1) == ':' or string.sub(rest, 1, 6) == '#hold:' then
      strings[#strings + 1] = key
    elseif string.sub(rest, 1, 12) == '#pool-holds:' or string.sub(rest, 1, 8) == '#holder:' then
      if redis.call('TYPE', key).ok == 'zset' and live_set(key, now) then return {0, key} end
    end
  end
  for i = n + 1, #KEYS do
    local key = KEYS[i]
    if redis.call('TYPE', key).ok == 'zset' then
      if live_set(key, now) then return {0, key} end
      if string.sub(key, -10) == '#deadlines' then
        for _, entry in ipairs(redis.call('ZRANGEBYSCORE', key, '-inf', '(' .. now, 'LIMIT', 0, 1000)) do
          if not string.find(entry, ' > ', 1, true) then return {0, key} end
        end
      end
    end
  end
  -- MGET reads a key of another type as empty
  for i = 1, #strings, 1000 do
    local batch = {unpack(strings, i, math.min(i + 999, #strings))}
    local values = redis.call('MGET', unpack(batch))
    for j, value in ipairs(values) do
      if value then
        local key = batch[j]
        local record = string.sub(key, tag + 1, tag + 6) == '#hold:'
        if (record and value ~= 'abandoned')
          or (not record and string.sub(value, 1, #sold) ~= sold) then
          return {0, key}
        end
      end
    end
  end
end
local deleted = 0
for i = 1, n, 1000 do
  deleted = deleted + redis.call('UNLINK', unpack(KEYS, i, math.min(i + 999, n)))
end
return {1, deleted}
