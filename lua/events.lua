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
-- entries after the cursor were already trimmed away (the reader must
-- reload seat states and start over from the newest id). A stream that
-- does not exist has nothing after any cursor, and "0-0" as newest.
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
local newest = '0-0'
for i = 1, #info, 2 do
  if info[i] == 'last-generated-id' then newest = info[i + 1] end
end
if ARGV[1] == '$' then
  return {1, {}, newest}
end
for i = 1, #info, 2 do
  if info[i] == 'max-deleted-entry-id' and ARGV[1] ~= '0-0' and older(ARGV[1], info[i + 1]) then
    return {0}
  end
end
return {1, redis.call('XRANGE', KEYS[1], '(' .. ARGV[1], '+', 'COUNT', ARGV[2]), newest}
