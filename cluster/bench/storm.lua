-- A conflict storm: single-seat holds, POST /v1/shows/{show}/seats/{seat}/hold
-- (no body), of seats of one hot show that are all held already: seats
-- h1..h<BENCH_HELD> of "<run>-hot", which bench.sh holds with curl before
-- the measured run. Every answer should be 409 (BENCH_EXPECT=409).
local dir = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
dofile(dir .. "common.lua")

local held = tonumber(os.getenv("BENCH_HELD") or "100")

function request()
   return wrk.format("POST", "/v1/shows/" .. run .. "-hot/seats/h" .. math.random(1, held) .. "/hold")
end
