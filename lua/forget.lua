-- forget.lua: remove the idempotency record of a confirm answered with a
-- failure (its WAIT fell short, or Redis did not answer), so that the
-- retry runs again as a fresh request; but only while the record is this
-- request's. A plain DEL would also remove the record of another request
-- sent under the same key meanwhile (a client's mistake, which it is
-- answered 422 for), and that request's retry would then run twice.
--
-- KEYS[1]  the idempotency record ("<fingerprint> <status> ...")
-- ARGV[1]  the fingerprint of the failed request
--
-- Returns 1 when this request's record was removed, 0 when there was none
-- or it is another request's (left as it is).
local record = redis.call('GET', KEYS[1])
if record and string.sub(record, 1, #ARGV[1] + 1) == ARGV[1] .. ' ' then
  return redis.call('DEL', KEYS[1])
end
return 0
