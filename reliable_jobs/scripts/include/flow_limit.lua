--[[
  include flow_limit: rate limits and concurrency caps, checked and taken by
  the claim (reliable_jobs/flow.py spells them; docs/design.md, "Flow control").

  The including script names as locals before the include line: flow_prefix
  (the queue's flow keys are flow_prefix .. 'log:' / 'tat:' / 'run:' /
  'held:' .. a limit's wire name), holds_key, leases_key and now (ms, server clock).

  A limit's wire name is 'r:' or 'c:' and its name (a task path, with '#'
  and a digest of the call's key for a per-key limit); the queue's own rate
  log is flow_prefix .. 'log:q'.

  - A rate limit of n per window_ms is a sliding log: a sorted set of the
    claims it admitted, scored by their time. A claim is admitted while
    fewer than n entries are newer than now - window_ms, so no window of
    window_ms on the server's clock ever holds more than n claims; and
    paced (flow_rate_room), so they are spread over the window.
  - A concurrency cap of n is a running set: a sorted set of the ids it
    admitted. A member counts while its id is in leases (or was admitted by
    this call, its lease written at the end), and is dropped as soon as a
    look finds it gone: a slot is held exactly as long as the job's lease,
    so a slot of a SIGKILLed worker comes back when the sweep recovers its
    expired lease, and no ack, nack or release needs to know about caps.
  - A job held by a limit waits on that limit's held list (oldest on the
    right, as on queued); holds_key scores each limit with a held list by
    the time (ms) it may let a job go. A job whose limit already holds
    older jobs queues behind them, so each limit keeps its jobs in order.
]]
-- Run sets live this long past their last claim (a day): a capped job
-- that runs longer than that after the last claim of its limit stops counting.
local FLOW_RUN_TTL_MS = 86400000
-- How soon a limit held by its cap (or the queue's cap) is looked at again.
local FLOW_CAP_RECHECK_MS = 10
-- How far ahead of its pacing a rate limit may admit a claim, in ms: a
-- worker that claims a little late (its sleep, the network) catches up
-- instead of losing rate; the sliding log still caps every window.
local FLOW_RATE_TOLERANCE_MS = 20
-- Ids this call admitted (their leases are written when the call ends).
local flow_admitted = {}

-- A payload's "flow" member (flow.job_spec), or nil: one anchored match.
local function flow_spec(payload)
  if type(payload) ~= 'string' or string.byte(payload, 3) ~= 102 then
    return nil
  end
  return string.match(payload, '^{"flow":"([^"]*)"')
end

-- The limits of a spec: { kind ('r' or 'c'), n, window_ms, wire name } each.
-- A limit flow.py would never write (a count of 0, a rate with no window)
-- is ignored rather than holding its jobs for ever.
local function flow_limits(spec)
  local limits = {}
  for kind, n, window, name in string.gmatch(spec, '([rc])/(%d+)/(%d+)/([^|]+)') do
    n, window = tonumber(n), tonumber(window)
    if n >= 1 and n <= 4503599627370496 and (kind == 'c' or window >= 1) then
      limits[#limits + 1] = { kind, n, window, kind .. ':' .. name }
    end
  end
  return limits
end

-- Claims in a rate log's window (older entries are dropped first). Each
-- flow key is spelled flow_prefix .. kind .. wire at its call, so the key
-- check of tests/luakeys.py sees it comes from KEYS.
local function flow_rate_used(wire, window_ms)
  redis.call('ZREMRANGEBYSCORE', flow_prefix .. 'log:' .. wire, '-inf', now - window_ms)
  return redis.call('ZCARD', flow_prefix .. 'log:' .. wire)
end

-- How many claims a rate limit of n per window_ms admits now, and, when
-- none, when (ms) it may admit one. Two rules, both on the server clock:
-- the sliding log (never more than n in any window: the hard limit), and
-- pacing (a GCRA whose theoretical arrival time, flow_prefix .. 'tat:' ..
-- wire, moves window_ms / n per claim, with FLOW_RATE_TOLERANCE_MS of
-- tolerance), so the n claims of a window are spread over it instead of
-- going in one burst that a clock other than the server's (a worker's)
-- would see straddle two windows.
local function flow_rate_room(wire, n, window_ms)
  local room = n - flow_rate_used(wire, window_ms)
  local free_at = nil
  if room <= 0 then
    local oldest = redis.call('ZRANGE', flow_prefix .. 'log:' .. wire, 0, 0, 'WITHSCORES')
    free_at = (tonumber(oldest[2]) or now) + window_ms
    room = 0
  end
  local step = window_ms / n
  local tolerance = math.min(FLOW_RATE_TOLERANCE_MS, window_ms)
  local tat = math.max(tonumber(redis.call('GET', flow_prefix .. 'tat:' .. wire)) or now, now)
  local paced = math.floor((now + tolerance - tat) / step) + 1
  if paced < room then
    room = math.max(paced, 0)
  end
  if room == 0 then
    local at = math.ceil(tat - tolerance)
    free_at = math.max(free_at or at, at)
  end
  return room, free_at
end

-- Record one admitted claim: an entry in the log, the pacing time moved on.
local function flow_rate_take(wire, n, window_ms, job_id)
  redis.call('ZADD', flow_prefix .. 'log:' .. wire, now, now .. ':' .. job_id)
  redis.call('PEXPIRE', flow_prefix .. 'log:' .. wire, window_ms + 1000)
  local tat = math.max(tonumber(redis.call('GET', flow_prefix .. 'tat:' .. wire)) or now, now)
  redis.call('SET', flow_prefix .. 'tat:' .. wire, tostring(tat + window_ms / n), 'PX',
    window_ms + 1000)
end

-- Jobs of a cap's running set still running; members whose lease is gone are dropped.
local function flow_running(wire)
  local n = 0
  for _, member in ipairs(redis.call('ZRANGE', flow_prefix .. 'run:' .. wire, 0, -1)) do
    if flow_admitted[member] or redis.call('ZSCORE', leases_key, member) then
      n = n + 1
    else
      redis.call('ZREM', flow_prefix .. 'run:' .. wire, member)
    end
  end
  return n
end

-- nil when every limit lets the job go now; else the wire name of the
-- first that holds it and when (ms) that limit may be tried again. A limit
-- with older jobs held (other than on own_wire, the list the job comes
-- from) holds it behind them.
local function flow_check(limits, own_wire)
  for _, limit in ipairs(limits) do
    local kind, n, window_ms, wire = limit[1], limit[2], limit[3], limit[4]
    if wire ~= own_wire and redis.call('LLEN', flow_prefix .. 'held:' .. wire) > 0 then
      return wire, now + FLOW_CAP_RECHECK_MS
    end
    if kind == 'r' then
      local room, free_at = flow_rate_room(wire, n, window_ms)
      if room < 1 then
        return wire, free_at
      end
    elseif flow_running(wire) >= n then
      return wire, now + FLOW_CAP_RECHECK_MS
    end
  end
  return nil
end

-- Take a slot of each limit for job_id (flow_check said yes).
local function flow_take(limits, job_id)
  for _, limit in ipairs(limits) do
    local wire = limit[4]
    if limit[1] == 'r' then
      flow_rate_take(wire, limit[2], limit[3], job_id)
    else
      redis.call('ZADD', flow_prefix .. 'run:' .. wire, now, job_id)
      redis.call('PEXPIRE', flow_prefix .. 'run:' .. wire, FLOW_RUN_TTL_MS)
    end
  end
  flow_admitted[job_id] = true
end

-- Put job_id behind the jobs its limit holds; the limit may let one go at retry_ms.
local function flow_hold(wire, job_id, retry_ms)
  redis.call('LPUSH', flow_prefix .. 'held:' .. wire, job_id)
  redis.call('ZADD', holds_key, 'LT', retry_ms, wire)
end
