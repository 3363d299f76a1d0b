-- Seat-state reads: GET /v1/shows/{show}/seats/{seat}, random show and seat
-- (mostly free seats; BENCH_EXPECT should be 200).
local dir = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
dofile(dir .. "common.lua")

function request()
   return wrk.format("GET", "/v1/shows/" .. random_show() .. "/seats/" .. random_seat())
end
