-- wrk script of bench/charge_parts.py: POST /payments, a new payment and a new Idempotency-Key per request.
-- Globals, not locals: wrk copies the script into each thread, and setup() sets a thread's id with thread:set.
counter = 0
tid = 0
token = os.getenv("BENCH_TOKEN")

setup = function(thread)
  thread:set("tid", tid)
  tid = tid + 1
end

init = function(args)
  math.randomseed(os.time() * 100 + tid)
end

request = function()
  counter = counter + 1
  local key = string.format("parts-%d-%d-%d", tid, counter, math.random(1, 1e9))
  local body = string.format(
    '{"order_no":"o-%s","amount":%d,"currency":"CNY","provider":"sandbox"}', key, 100 + counter % 1000)
  return wrk.format("POST", "/payments", {
    ["Content-Type"] = "application/json",
    ["Authorization"] = "Bearer " .. token,
    ["Idempotency-Key"] = key,
  }, body)
end
