-- wrk script of the benchmark (bench/load.py runs it):
--   wrk ... -s bench/keys.lua URL -- RUN_ID MODE PATH [FIXED_KEY]
-- MODE "new": a unique Idempotency-Key per request (run id, thread id, counter);
-- "fixed": FIXED_KEY on every request (replays); "none": no key header.
-- Every non-2xx answer is a failure: the thread stops at its first one, and done()
-- reports the count with the first failure's status and body.

local threads = {}
local next_id = 1

function setup(thread)
  thread:set("id", next_id)
  next_id = next_id + 1
  table.insert(threads, thread)
end

local counter = 0
local run_id, mode, path, fixed_key
failures = 0
first_status = 0
first_body = ""

function init(args)
  run_id, mode, path, fixed_key = args[1], args[2], args[3], args[4]
end

local body = '{"amount": 500, "note": "bench"}'

function request()
  counter = counter + 1
  local headers = { ["Content-Type"] = "application/json" }
  if mode == "new" then
    headers["Idempotency-Key"] = run_id .. "-" .. id .. "-" .. counter
  elseif mode == "fixed" then
    headers["Idempotency-Key"] = fixed_key
  end
  return wrk.format("POST", path, headers, body)
end

function response(status, headers, body)
  if status < 200 or status > 299 then
    failures = failures + 1
    if first_status == 0 then
      first_status = status
      first_body = body or ""
    end
    wrk.thread:stop()
  end
end

function done(summary, latency, requests)
  local count, status, text = 0, 0, ""
  for _, thread in ipairs(threads) do
    count = count + (thread:get("failures") or 0)
    local s = thread:get("first_status") or 0
    if s ~= 0 and status == 0 then
      status = s
      text = thread:get("first_body") or ""
    end
  end
  local e = summary.errors
  io.write(string.format(
    "BENCH-RESULT requests=%d duration_us=%d p50_us=%d p99_us=%d failures=%d status=%d "
      .. "connect=%d read=%d write=%d timeout=%d\n",
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    count, status, e.connect, e.read, e.write, e.timeout))
  io.write("BENCH-BODY " .. string.gsub(text, "\n", " ") .. "\n")
end
