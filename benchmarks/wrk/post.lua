-- wrk script for benchmarks/run.py: POST one JSON body with the X-Bench-User header and an
-- Idempotency-Key that is either new for every request (random, so that claims land all
-- over the unique index, as UUIDs from real clients do) or one fixed key (replays).
--
--   wrk -s benchmarks/wrk/post.lua URL -- USER new|fixed:KEY BODY [TOKEN]
-- TOKEN, when given, is sent as "Authorization: Token TOKEN" (DRF's TokenAuthentication).
-- At the end it prints one line: "BENCH-JSON {...}" with counts and latency percentiles.

local threads = {}
local next_id = 0

function setup(thread)
  next_id = next_id + 1
  thread:set("tid", next_id)
  table.insert(threads, thread)
end

local user, mode, fixed_key, body, token, counter

function init(args)
  user = args[1]
  mode = args[2]
  body = args[3]
  token = args[4]
  if string.sub(mode, 1, 6) == "fixed:" then
    fixed_key = string.sub(mode, 7)
  end
  counter = 0
  math.randomseed(os.time() * 1000 + tid * 7919)
end

local function hex16()
  return string.format("%04x", math.random(0, 65535))
end

function request()
  local key = fixed_key
  if key == nil then
    counter = counter + 1
    key = hex16() .. hex16() .. "-" .. hex16() .. "-" .. hex16() .. "-" .. hex16() .. "-"
      .. hex16() .. hex16() .. hex16() .. "-" .. tid .. "-" .. counter
  end
  local headers = {
    ["Content-Type"] = "application/json",
    ["X-Bench-User"] = user,
    ["Idempotency-Key"] = key,
    ["Connection"] = "close",
  }
  if token ~= nil then
    headers["Authorization"] = "Token " .. token
  end
  return wrk.format("POST", nil, headers, body)
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'BENCH-JSON {"requests": %d, "duration_us": %d, "connect_errors": %d, '
      .. '"read_errors": %d, "write_errors": %d, "status_errors": %d, "timeouts": %d, '
      .. '"p50_us": %d, "p90_us": %d, "p99_us": %d, "max_us": %d}\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max))
end
