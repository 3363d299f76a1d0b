-- Seat-state reads of one hot show: GET /v1/shows/{show}/seats/{seat} of
-- seats h1..h<BENCH_HELD> of "<run>-hot", held by bench.sh with curl before
-- the measured run (BENCH_EXPECT=200).
local dir = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
dofile(dir .. "common.lua")

local held = tonumber(os.getenv("BENCH_HELD") or "100")

function request()
   return wrk.format("GET", "/v1/shows/" .. run .. "-hot/seats/h" .. math.random(1, held))
end
