-- Pool holds: POST /v1/shows/{show}/holds with {"pools":{"<pool>":1}}, one
-- unit each, all from one hot pool of one hot show ("<run>-hot").
-- cluster/bench.sh creates the pool (PUT /v1/shows/{show}/pools/{pool}, a
-- capacity no step can use up) before the warm-up and before the measured
-- run, after the cluster was emptied. BENCH_POOL names it (default
-- "coupons").
local dir = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
dofile(dir .. "common.lua")

local headers = { ["Content-Type"] = "application/json" }
local pool = os.getenv("BENCH_POOL") or "coupons"
local body = '{"pools":{"' .. pool .. '":1}}'

function request()
   return wrk.format("POST", "/v1/shows/" .. run .. "-hot/holds", headers, body)
end
