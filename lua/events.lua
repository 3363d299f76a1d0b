#!lua flags=no-writes
-- events.lua: read a show's events after a cursor. Read-only.
--
-- KEYS[1]  the show's event stream
-- ARGV[1]  cursor: the last id the reader has ("0-0" for everything still
--          kept, never 410; "$" for nothing but the newest id)
-- ARGV[2]  most entries to answer
--
-- Returns {1, entries, newest} with up to ARGV[2] entries after the cursor,
-- as XRANGE answers them, and the newest id the stream ever had; {0} when
-- entries after the cursor may have been trimmed away (the reader must
-- reload seat states and start over from the newest id). A stream that
-- does not exist has nothing after any cursor, and "0-0" as newest.
--
-- Trimming (XADD MAXLEN ~) removes the oldest entries but does not move
-- XINFO's max-deleted-entry-id (only XDEL does, and hold.lua XDELs entries
-- it rewrites, which lost nothing). So a cursor is too old when the stream
-- has lost entries (entries-added > length) and the cursor is before its
-- first kept entry: the entry right after the cursor may be gone. A client
-- whose cursor is exactly the last trimmed entry gets 410 too, needlessly
-- but safely; a cursor at or after the first kept entry never does.
local function older(a, b)
  local ams, aseq = string.match(a, '^(%d+)-(%d+)$')
  local bms, bseq = string.match(b, '^(%d+)-(%d+)$')
  ams, aseq, bms, bseq = tonumber(ams), tonumber(aseq), tonumber(bms), tonumber(bseq)
  return ams < bms or (ams == bms and aseq < bseq)
end
if redis.call('EXISTS', KEYS[1]) == 0 then
  return {1, {}, '0-0'}
end
local info = redis.call('XINFO', 'STREAM', KEYS[1])
local newest, length, added, first = '0-0', 0, 0, nil
for i = 1, #info, 2 do
  local k, v = info[i], info[i + 1]
  if k == 'last-generated-id' then newest = v
  elseif k == 'length' then length = v
  elseif k == 'entries-added' then added = v
  elseif k == 'first-entry' and type(v) == 'table' then first = v[1]
  end
end
if ARGV[1] == '$' then
  return {1, {}, newest}
end
if ARGV[1] ~= '0-0' and added > length and older(ARGV[1], first or newest) then
  return {0}
end
return {1, redis.call('XRANGE', KEYS[1], '(' .. ARGV[1], '+', 'COUNT', ARGV[2]), newest}
