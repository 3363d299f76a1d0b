-- Shared part of the seathold wrk scripts (cluster/bench/*.lua); each
-- scenario script loads this file and then defines request().
--
-- Every response is counted by HTTP status in the `response` callback, per
-- wrk thread; `done` adds the threads up and prints one machine-readable
-- line, which cluster/bench.sh parses:
--
--   BENCH<TAB>key=value<TAB>key=value...
--
-- Settings come from the environment (read the same way in every thread):
--   BENCH_RUN     unique prefix for show ids, so steps never share keys
--   BENCH_EXPECT  the status that counts as success (201 for holds, 200 reads)
--   BENCH_SEATS   seats per hold (holds.lua), default 4
--   BENCH_SHOWS   number of distinct shows to draw from (0 = one hot show)
--
-- Seat ids never repeat within a run: "s<thread>x<n>" where n is a per-thread
-- sequence number scrambled by multiplying with an odd constant modulo 2^32
-- (a bijection, so no two seats of a thread are equal, yet consecutive seats
-- look random). Random draws from even 10^9 seats collide by the birthday
-- paradox (about n^2 / 2*10^9 conflicts after n seats of one hot show), and
-- a 409 must mean something is wrong, not bad luck.

local threads = {}

function setup(thread)
   -- Runs in the main Lua state, once per wrk thread, before init.
   thread:set("tid", #threads + 1)
   table.insert(threads, thread)
end

run = os.getenv("BENCH_RUN") or "bench"
expect = tonumber(os.getenv("BENCH_EXPECT") or "201")
nseats = tonumber(os.getenv("BENCH_SEATS") or "4")
nshows = tonumber(os.getenv("BENCH_SHOWS") or "1000000")

function init(args)
   -- Runs in each thread's own Lua state.
   counts = {}
   first_bad = ""
   seq = 0
   math.randomseed(os.time() * 1000 + (tid or 0) * 7919 + math.floor(os.clock() * 1000000))
   -- Throw away the first few numbers of a freshly seeded generator.
   for _ = 1, 10 do math.random() end
end

-- A random show id: "<run>-<n>", or the single hot show "<run>-hot".
function random_show()
   if nshows == 0 then
      return run .. "-hot"
   end
   return run .. "-" .. math.random(1, nshows)
end

-- A fresh, random-looking seat id, distinct from every other of this run.
-- seq * 2654435761 mod 2^32, computed in two 16-bit halves of the constant
-- (40503 * 2^16 + 31153) so that every product stays exact in a double.
function random_seat()
   seq = seq + 1
   local scrambled = (seq * 31153 + ((seq * 40503) % 65536) * 65536) % 4294967296
   return "s" .. (tid or 0) .. "x" .. string.format("%d", scrambled)
end

function response(status, headers, body)
   counts[status] = (counts[status] or 0) + 1
   if status ~= expect and first_bad == "" then
      first_bad = string.sub(body or "", 1, 200)
   end
end

function done(summary, latency, requests)
   local total, ok = 0, 0
   local by_status = {}
   local sample = ""
   for _, t in ipairs(threads) do
      local c = t:get("counts") or {}
      for status, n in pairs(c) do
         by_status[status] = (by_status[status] or 0) + n
         total = total + n
         if status == expect then ok = ok + n end
      end
      local b = t:get("first_bad")
      if sample == "" and b and b ~= "" then sample = b end
   end
   local keys = {}
   for status in pairs(by_status) do table.insert(keys, status) end
   table.sort(keys)
   local parts = {}
   for _, status in ipairs(keys) do
      table.insert(parts, status .. ":" .. by_status[status])
   end
   local e = summary.errors
   local fields = {
      "duration_us=" .. summary.duration,
      "requests=" .. summary.requests,
      "counted=" .. total,
      "ok=" .. ok,
      "not_ok=" .. (total - ok),
      "statuses=" .. (#parts > 0 and table.concat(parts, ",") or "none"),
      "socket_errors=" .. (e.connect + e.read + e.write + e.timeout),
      "timeouts=" .. e.timeout,
      "p50_us=" .. latency:percentile(50),
      "p99_us=" .. latency:percentile(99),
      "max_us=" .. latency.max,
      "mean_us=" .. string.format("%.0f", latency.mean),
      "sample=" .. string.gsub(sample, "[\t\r\n]", " "),
   }
   io.write("BENCH\t" .. table.concat(fields, "\t") .. "\n")
end
