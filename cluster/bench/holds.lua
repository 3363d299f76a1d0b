-- N-seat holds: POST /v1/shows/{show}/holds with {"seats":[...]} of
-- BENCH_SEATS distinct seats (see random_seat) of a random show (or one hot
-- show).
local dir = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
dofile(dir .. "common.lua")

local headers = { ["Content-Type"] = "application/json" }

function request()
   local seats = {}
   for i = 1, nseats do
      seats[i] = '"' .. random_seat() .. '"'
   end
   local body = '{"seats":[' .. table.concat(seats, ",") .. "]}"
   return wrk.format("POST", "/v1/shows/" .. random_show() .. "/holds", headers, body)
end
