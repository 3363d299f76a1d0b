-- sweep.lua: write the `expired` event of every hold of one show whose time
-- ran out, exactly once.
--
-- KEYS[1]  the show's deadline index: "<ref> <fence> <seats>" scored with
--          the hold's expiry (ms, Redis's clock); hold.lua and extend.lua
--          add to it, modify.lua replaces a hold's entry, release.lua,
--          confirm.lua and abandon.lua remove. A
--          hold of several shows also has "<ref> > <index key>" in each,
--          its link to the next show's index, with the same score
-- KEYS[2]  the show's event stream
-- KEYS[3]  the record of this run ("<prefix>{show:<show>}#sweep:<run id>")
-- ARGV[1]  approximate length cap of the stream
-- ARGV[2]  most holds to expire in one run
-- ARGV[3]  how long the record of a run that wrote something is kept, ms
--
-- A run whose answer was lost (a timeout, a broken connection: the script
-- may have run) is sent again under the same run id, by the daemon or by
-- the cluster client. The resend answers what the first run wrote, from
-- its record, with what it wrote itself, so that the instance counts those
-- events: without it the resend found nothing due, and no instance counted
-- events that were in the stream. The record is read together with its
-- writing (SET NX GET), or alone when a run wrote nothing: one call more
-- per run, not two. (A resend's own part is not added to the record: were
-- its answer lost too, a third run would answer the first's alone.)
--
-- Each due entry is removed and its event appended in this one script, with
-- Redis's clock deciding what is due: two instances sweeping the same show
-- can never both write an expiry, and one that was not replicated before a
-- failover is still in the new master's index, so it is written there.
--
-- An entry is due once Redis's clock is past its expiry (Redis keeps a key
-- through its expiry millisecond, so an extend in that millisecond wins).
--
-- Returns {written, next_ms, {index key...}, ref...}: the events written,
-- the time until the next deadline of the show (0 when more are due now, -1
-- when none is left), the indexes that due links name (the instance sweeps
-- those shows next: their entries of the same holds are due too), and the
-- refs of the holds whose events were written (the instance then ignores
-- Redis's expiry notifications of those holds' records).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

-- The time until the show's next deadline (0: due now), -1 when none.
local function next_in()
  local next = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  if #next == 0 then return -1 end
  return math.max(tonumber(next[2]) - now, 0)
end

-- Strings to Redis: a number would be printed with "%.17g" (see hold.lua).
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', string.format('(%d', now),
  'WITHSCORES', 'LIMIT', '0', ARGV[2])
local links = {}
local reply = {0, -1, links}
for i = 1, #due, 2 do
  local ref, fence, seats = string.match(due[i], '^(%S+) (%d+) (.*)$')
  redis.call('ZREM', KEYS[1], due[i])
  if ref then
    redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*',
      't', 'expired', 'r', ref, 's', seats, 'f', fence, 'x', due[i + 1])
    reply[1] = reply[1] + 1
    reply[#reply + 1] = ref
  else
    local link = string.match(due[i], '^%S+ > (.+)$')
    if link then links[#links + 1] = link end
  end
end
local first
if reply[1] > 0 or #links > 0 then
  first = redis.call('SET', KEYS[3], cjson.encode(reply), 'NX', 'GET', 'PX', ARGV[3])
else
  first = redis.call('GET', KEYS[3])
end
if first then
  first = cjson.decode(first)
  reply[1] = reply[1] + first[1]
  for _, link in ipairs(first[3]) do links[#links + 1] = link end
  for i = 4, #first do reply[#reply + 1] = first[i] end
end
reply[2] = next_in()
return reply
