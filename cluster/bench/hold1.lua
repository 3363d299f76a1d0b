-- Single-seat holds: POST /v1/shows/{show}/seats/{seat}/hold, no body,
-- random show (BENCH_SHOWS of them, or one hot show if 0) and a fresh seat.
local dir = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
dofile(dir .. "common.lua")

function request()
   return wrk.format("POST", "/v1/shows/" .. random_show() .. "/seats/" .. random_seat() .. "/hold")
end
