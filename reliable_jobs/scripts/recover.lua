--[[
  recover: put jobs whose lease expired back on queued (or bury them).

  KEYS[1] queued      list   ids ready to run (the oldest on the right)
  KEYS[2] processing  list   ids claimed and not yet acked
  KEYS[3] leases      zset   id -> lease deadline (ms, server clock)
  KEYS[4] dead        zset   id -> time of death (ms)
  KEYS[5] wake        list   at most one marker, pushed when work arrives
  KEYS[6] job prefix  string job hashes are KEYS[6] .. id (same {queue} slot)

  ARGV[1] limit           expired leases handled per call at most
  ARGV[2] lease_ms        lease given to an id found on processing without one
  ARGV[3] orphan_scan     how many ids at the tail of processing to inspect

  An expired 'running' job whose attempt never started (no start mark for
  it, see start.lua) goes back on the right of queued with one more attempt
  in its budget (max_attempts + 1): its worker died before running it, so
  it is not charged. One whose attempt started and whose attempts are spent
  goes to dead (G3); otherwise it goes back on the right of queued, to run
  next. An id on
  processing with no lease at all (its worker died between BLMOVE and the
  claim script) is stamped with a lease the first time it is seen, and comes
  back when that expires without being charged an attempt: its state is
  still 'queued' because no claim ever ran.

  An id with no job hash is garbage and goes to dead; so does one whose hash
  is damaged (no state, or a state no script writes), and that hash is
  deleted so that reconcile rebuilds the job from the database. attempts
  and max_attempts are read as whole numbers from 0 (1) to 2^31 - 1 (the
  mirror's integer columns), whatever the hash holds.

  Safe to run concurrently with itself, workers and other sweeps: each step
  is one atomic script, and an id is acted on only if LREM found it.

  Returns: { outcomes, stamped }
    outcomes  flat list: id, attempts, max_attempts, kind per handled lease,
              where kind is 'expired' (requeued), 'unstarted' (requeued,
              refunded), 'dead', 'orphan' (requeued, never claimed),
              'garbage' (no job hash, or a damaged one) or 'dropped'
              (stray copy of a job that lives elsewhere)
    stamped   how many orphans got a first lease
  Errors: limit, lease_ms or orphan_scan not a whole number from 0 to 2^52
  (nothing is written).
]]
local queued_key = KEYS[1]
local processing_key = KEYS[2]
local leases_key = KEYS[3]
local dead_key = KEYS[4]
local wake_key = KEYS[5]
local job_prefix = KEYS[6]

-- A whole number from ARGV, or an error reply before anything is written.
local function whole(value, name)
  local n = tonumber(value)
  if n == nil or n ~= math.floor(n) or n < 0 or n > 4503599627370496 then
    error({ err = 'ERR recover: ' .. name .. ' must be a whole number from 0 to 2^52, not '
      .. string.sub(tostring(value), 1, 40) })
  end
  return n
end

-- A counter read from a job hash, clamped to the mirror's integer range.
local MAX_COUNT = 2147483647
local function count_of(value, lowest)
  local n = tonumber(value)
  if n == nil or n ~= n then
    return lowest
  end
  return math.max(lowest, math.min(MAX_COUNT, math.floor(n)))
end

local KNOWN_STATES = { queued = true, running = true, scheduled = true, dead = true }

local limit = whole(ARGV[1], 'limit')
local lease_ms = whole(ARGV[2], 'lease_ms')
local orphan_scan = whole(ARGV[3], 'orphan_scan')

local clock = redis.call('TIME')
local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)

local outcomes = {}
local requeued = 0
local expired = redis.call('ZRANGEBYSCORE', leases_key, '-inf', now_ms, 'LIMIT', 0, limit)
for _, job_id in ipairs(expired) do
  redis.call('ZREM', leases_key, job_id)
  if redis.call('LREM', processing_key, -1, job_id) > 0 then
    local job_key = job_prefix .. job_id
    local job = redis.call('HMGET', job_key, 'state', 'attempts', 'max_attempts', 'started')
    local attempts = count_of(job[2], 0)
    local max_attempts = count_of(job[3], 1)
    local kind
    if not KNOWN_STATES[job[1]] then
      kind = 'garbage'
      redis.call('DEL', job_key)
      redis.call('ZADD', dead_key, now_ms, job_id)
    elseif job[1] == 'running' and job[4] ~= job[2] then
      kind = 'unstarted'
      max_attempts = math.min(max_attempts + 1, MAX_COUNT)
      redis.call('HSET', job_key, 'state', 'queued', 'max_attempts', max_attempts)
      redis.call('RPUSH', queued_key, job_id)
      requeued = requeued + 1
    elseif job[1] == 'running' and attempts >= max_attempts then
      kind = 'dead'
      redis.call('ZADD', dead_key, now_ms, job_id)
      redis.call('HSET', job_key, 'state', 'dead', 'finished_ms', now_ms, 'last_error',
        'LeaseExpired: the lease of attempt ' .. attempts .. ' of ' .. max_attempts ..
        ' expired (worker lost or stalled) and no attempt is left')
    elseif job[1] == 'running' or job[1] == 'queued' then
      if job[1] == 'running' then kind = 'expired' else kind = 'orphan' end
      redis.call('HSET', job_key, 'state', 'queued')
      redis.call('RPUSH', queued_key, job_id)
      requeued = requeued + 1
    else
      kind = 'dropped'
    end
    outcomes[#outcomes + 1] = job_id
    outcomes[#outcomes + 1] = attempts
    outcomes[#outcomes + 1] = max_attempts
    outcomes[#outcomes + 1] = kind
  end
end

local stamped = 0
if orphan_scan > 0 then
  for _, job_id in ipairs(redis.call('LRANGE', processing_key, -orphan_scan, -1)) do
    stamped = stamped + redis.call('ZADD', leases_key, 'NX', now_ms + lease_ms, job_id)
  end
end

if requeued > 0 and redis.call('LLEN', wake_key) == 0 then
  redis.call('RPUSH', wake_key, '1')
end
return { outcomes, stamped }
