-- wrk script for bench/ingest.py: replays pre-signed sandbox callbacks.
--
-- wrk -s bench/replay.lua URL -- <requests file> <threads>
-- The file has one request per line: "<Sandbox-Signature value>\t<raw JSON body>".
-- Thread k of n takes lines k, k+n, k+2n, ... so threads send distinct events;
-- a thread that runs out starts its slice again and counts the wrap.
-- done() prints one line "BENCH_JSON {...}" that bench/ingest.py parses.

local threads = {}
local counter = 0

function setup(thread)
  thread:set("id", counter)
  counter = counter + 1
  table.insert(threads, thread)
end

function init(args)
  local path = args[1]
  local nthreads = tonumber(args[2])
  requests = {}
  wraps = 0
  local n = 0
  for line in io.lines(path) do
    if n % nthreads == id then
      local tab = line:find("\t", 1, true)
      local headers = {
        ["Content-Type"] = "application/json",
        ["User-Agent"] = "paysync-bench",
        ["Sandbox-Signature"] = line:sub(1, tab - 1),
      }
      requests[#requests + 1] = wrk.format("POST", nil, headers, line:sub(tab + 1))
    end
    n = n + 1
  end
  i = 0
end

function request()
  i = i + 1
  if i > #requests then
    i = 1
    wraps = wraps + 1
  end
  return requests[i]
end

function done(summary, latency, requests)
  local total_wraps = 0
  for _, t in ipairs(threads) do
    total_wraps = total_wraps + (t:get("wraps") or 0)
  end
  local e = summary.errors
  io.write(string.format(
    'BENCH_JSON {"requests":%d,"duration_us":%d,"non2xx":%d,"connect":%d,"read":%d,"write":%d,'
      .. '"timeout":%d,"p50_us":%d,"p90_us":%d,"p99_us":%d,"max_us":%d,"mean_us":%.1f,"wraps":%d}\n',
    summary.requests, summary.duration, e.status, e.connect, e.read, e.write, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max, latency.mean,
    total_wraps))
end
