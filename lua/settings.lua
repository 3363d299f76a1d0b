-- settings.lua: set a show's settings.
--
-- KEYS[1]  the show's settings (a hash)
-- ARGV[1]  maxPerHolder: the most seats plus pool units one holder may have
--          held or bought in the show (0: no limit)
--
-- Returns the stored maxPerHolder.
redis.call('HSET', KEYS[1], 'maxPerHolder', ARGV[1])
return tonumber(redis.call('HGET', KEYS[1], 'maxPerHolder'))
