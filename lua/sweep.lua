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
-- ARGV[1]  approximate length cap of the stream
-- ARGV[2]  most holds to expire in one run
-- ARGV[3]  this run's id (16 hex digits), written into its events (`u`)
-- ARGV[4]  "" for a first run; for a run sent again under the id of one
--          whose answer was lost, the stream id from which that one may
--          have written
--
-- A run whose answer was lost (a timeout, a broken connection: the script
-- may have run) is sent again under the same run id. The resend answers
-- the events the first run wrote too, found by their `u` among the
-- stream's entries since ARGV[4], so that the instance counts them:
-- without it the resend found nothing due, and no instance counted events
-- that were in the stream. A first run pays for this with two arguments of
-- each XADD, no call. (The links a lost answer named are not found again:
-- their shows are swept at their own deadlines or by the next scan.)
--
-- Each due entry is removed and its event appended in this one script, with
-- Redis's clock deciding what is due: two instances sweeping the same show
-- can never both write an expiry, and one that was not replicated before a
-- failover is still in the new master's index, so it is written there.
--
-- An entry is due once Redis's clock is past its expiry (Redis keeps a key
-- through its expiry millisecond, so an extend in that millisecond wins).
--
-- A hold of several shows expires in each of them, one event per show, but
-- is one hold: only one show counts it, the one whose link names a show of
-- lower id. The daemon gives every script a hold's shows in id order, and
-- the links go round them (each show to the next, the last to the first),
-- so that is the last show, exactly one. Its event (and only its) has no
-- `c 0` at its end, so a resend counts what its first run counted. Ids are
-- compared byte by byte, as the daemon orders them (Lua's `<` follows the
-- server's locale). A hold's link has its entry's score and sorts right
-- after it ('>' after the fence's digits), so the two are read together:
-- a batch that ends between them leaves the entry to the next run.
--
-- Returns {written, next_ms, {index key...}, counted, ref...}: the events
-- written, the time until the next deadline of the show (0 when more are
-- due now, -1 when none is left), the indexes that due links name (the
-- instance sweeps those shows next: their entries of the same holds are due
-- too), the holds that expired (written, less the events of holds of
-- several shows that another show counts), and the refs of the holds whose
-- events were written (the instance then ignores Redis's expiry
-- notifications of those holds' records).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- Strings to Redis: a number would be printed with "%.17g" (see hold.lua).
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', string.format('(%d', now),
  'WITHSCORES', 'LIMIT', '0', ARGV[2])
local links = {}
local reply = {0, -1, links, 0}

-- Whether show id a sorts before b, byte by byte, from their index keys
-- ("<prefix>{show:<id>}#deadlines": the same prefix, the same end).
local function before(a, b)
  a, b = string.sub(a, 1, -12), string.sub(b, 1, -12)
  for i = 1, math.min(#a, #b) do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x < y end
  end
  return #a < #b
end

if ARGV[4] ~= '' then
  local since = redis.call('XRANGE', KEYS[2], ARGV[4], '+', 'COUNT', '10000')
  for _, entry in ipairs(since) do
    local f = entry[2]
    -- t expired r <ref> s <seats> f <fence> x <expiry> u <run> [c 0]
    if f[12] == ARGV[3] and f[11] == 'u' then
      reply[1] = reply[1] + 1
      if f[13] ~= 'c' then reply[4] = reply[4] + 1 end
      reply[#reply + 1] = f[4]
    end
  end
end
local full = #due == 2 * tonumber(ARGV[2])
for i = 1, #due, 2 do
  local ref, fence, seats = string.match(due[i], '^(%S+) (%d+) (.*)$')
  local linked
  if ref then
    -- its link may come next (never at the head: a batch of one would
    -- stall)
    if i > 1 and i + 2 > #due and full then break end
    local of, to = string.match(due[i + 2] or '', '^(%S+) > (.+)$')
    if of == ref then linked = to end
  end
  redis.call('ZREM', KEYS[1], due[i])
  if ref then
    local fields = {'t', 'expired', 'r', ref, 's', seats, 'f', fence, 'x', due[i + 1], 'u', ARGV[3]}
    if linked and not before(linked, KEYS[1]) then
      fields[13], fields[14] = 'c', '0'
    else
      reply[4] = reply[4] + 1
    end
    redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', unpack(fields))
    reply[1] = reply[1] + 1
    reply[#reply + 1] = ref
  else
    local link = string.match(due[i], '^%S+ > (.+)$')
    if link then links[#links + 1] = link end
  end
end
local next = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
if #next > 0 then
  reply[2] = math.max(tonumber(next[2]) - now, 0)
end
return reply
