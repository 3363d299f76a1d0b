#!lua flags=no-writes
-- events.lua: read a show's events after a cursor. Read-only.
--
-- KEYS[1]  the show's event stream
-- KEYS[2]  how many entries the scripts deleted from it themselves
--          (hold.lua's xdel)
-- ARGV[1]  cursor: the last id the reader has ("0-0": before every entry,
--          see ARGV[6]; "$" for nothing but the newest id)
-- ARGV[2]  most entries to answer
-- ARGV[3]  "1" when the cursor is an event the reader had from this stream
--          (Last-Event-ID, a show reader's own position), "0" when it is a
--          position (?after=, possibly made from a time)
-- ARGV[4]  the streams' length cap (--events-max-len; not used since a
--          trim is told by KEYS[2], whatever cap trimmed the stream)
-- ARGV[5]  "1" to answer also the entry before a position (see below)
-- ARGV[6]  "1" when the reader sent no cursor: "0-0" then means everything
--          still kept, never 410
--
-- Returns {1, entries, newest, before, added} with up to ARGV[2] entries
-- after the cursor, as XRANGE answers them; the id of the newest entry kept
-- ("0-0" when none); when ARGV[5] is "1", after a position (ARGV[3] =
-- "0", not "0-0") followed by entries, the newest entry at or before it
-- ("0-0" when none; "" in other cases); and XINFO's entries-added, which only grows in one stream
-- (a stream deleted and begun again starts over from 0); {0} when the cursor cannot be resumed from exactly (the reader
-- must reload seat states and start over from the newest id):
--
-- - Entries after it may have been trimmed away. A cursor is too old when
--   the stream was trimmed and the cursor is before its first kept entry:
--   the entry right after the cursor may be gone. A client whose cursor is
--   exactly the last trimmed entry gets 410 too, needlessly but safely.
--   Whether it was trimmed: XINFO's entries-added above its length says
--   that entries went, but so do the scripts' own XDELs (an event
--   rewritten under another id, or undone in the run that wrote it), which
--   lost nothing; the scripts count those in KEYS[2], so entries gone
--   beyond that count were trimmed. (Before that count, a stream below the
--   reader's own cap counted as never trimmed, which a stream trimmed under
--   a smaller cap is not. A stream whose scripts deleted entries before
--   they were counted counts as trimmed: 410, needlessly but safely. An
--   XDEL by hand counts as a trim too.)
-- - An event the reader had (ARGV[3] = "1") that the stream no longer
--   has: a failover lost it (the replica promoted never had it, nor the
--   transitions before it that a seat map already shows), or the stream
--   went with it (deleted, by delete-show, and maybe begun again by later
--   holds: then the cursor is before its first entry, though it lost none). Every entry a
--   reader can see stays until trimmed: the scripts XDEL only entries they
--   wrote in the same run.
-- A position (ARGV[3] = "0") before the first entry of a stream that was
-- never trimmed is resumed (everything kept follows it). So is "0-0" sent
-- as a cursor, by a reader or as a Last-Event-ID (an empty stream answers
-- it as its position): 410 once the stream was trimmed, as entries after it
-- went. Only a reader that sent no cursor (ARGV[6] = "1") gets everything
-- kept, always.
local function older(a, b)
  local ams, aseq = string.match(a, '^(%d+)-(%d+)$')
  local bms, bseq = string.match(b, '^(%d+)-(%d+)$')
  ams, aseq, bms, bseq = tonumber(ams), tonumber(aseq), tonumber(bms), tonumber(bseq)
  return ams < bms or (ams == bms and aseq < bseq)
end
local cursor, exact = ARGV[1], ARGV[3] == '1'
if redis.call('EXISTS', KEYS[1]) == 0 then
  if exact and cursor ~= '0-0' then return {0} end
  return {1, {}, '0-0', '', 0}
end
local info = redis.call('XINFO', 'STREAM', KEYS[1])
local length, added, first, newest = 0, 0, nil, '0-0'
for i = 1, #info, 2 do
  local k, v = info[i], info[i + 1]
  if k == 'length' then length = v
  elseif k == 'entries-added' then added = v
  elseif k == 'first-entry' and type(v) == 'table' then first = v[1]
  elseif k == 'last-entry' and type(v) == 'table' then newest = v[1]
  end
end
-- Whether entries went that the scripts did not delete themselves.
local function trimmed()
  return added - length > (tonumber(redis.call('GET', KEYS[2])) or 0)
end
if cursor == '$' then
  return {1, {}, newest, '', added}
end
if cursor == '0-0' then
  if ARGV[6] ~= '1' and first and trimmed() then
    return {0}
  end
else
  if not first then
    -- Every entry deleted (XDEL of entries no reader saw): an event a
    -- reader had is gone.
    if exact then return {0} end
  elseif older(cursor, first) then
    if exact or trimmed() then return {0} end
  elseif exact and #redis.call('XRANGE', KEYS[1], cursor, cursor) == 0 then
    return {0}
  end
end
local entries = redis.call('XRANGE', KEYS[1], '(' .. cursor, '+', 'COUNT', ARGV[2])
if ARGV[5] ~= '1' or exact or cursor == '0-0' or #entries == 0 then
  return {1, entries, newest, '', added}
end
-- A position followed by entries: also the newest entry at or before it
-- (0-0 when none), which names the same place as an entry, so that a
-- client can resume from it exactly (an SSE stream's opening frame).
local at = redis.call('XREVRANGE', KEYS[1], cursor, '-', 'COUNT', 1)
return {1, entries, newest, at[1] and at[1][1] or '0-0', added}
