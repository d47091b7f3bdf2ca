--[[
  claim: move up to N jobs from queued to processing and stamp each one.

  KEYS[1] queued      list   ids ready to run (the oldest on the right)
  KEYS[2] processing  list   ids claimed and not yet acked
  KEYS[3] leases      zset   id -> lease deadline (ms, server clock)
  KEYS[4] dead        zset   id -> time of death (ms)
  KEYS[5] wake        list   at most one marker, pushed when work is left
  KEYS[6] job prefix  string job hashes are KEYS[6] .. id (same {queue} slot)
  KEYS[7] landing     list   ids a worker moved off queued with BLMOVE and
                             has not stamped yet (a few at most)

  ARGV[1] count     how many jobs to claim at most
  ARGV[2] lease_ms  lease length in milliseconds
  ARGV[3] moved_id  an id the worker already moved onto landing with BLMOVE
                    (stamped first, and moved onto processing), or '' for
                    none; ignored when it is no longer on landing (a sweep
                    requeued it as an orphan while the worker stalled)

  Taking the batch with LRANGE + LTRIM + LPUSH inside one script is the same
  atomic move as LMOVE, for many ids at once: an id is always on exactly one
  of the two lists. Each claimed job gets attempts + 1 (the fencing token),
  state 'running' and a lease. A job whose attempts already reached
  max_attempts goes to dead instead (G3). An id with no job hash is garbage:
  it is moved aside to dead and reported. So is an id whose hash is damaged
  (no state, or a state no script writes), and the damaged hash is deleted,
  so that reconcile rebuilds the job from the database. A copy of an id
  whose job is not 'queued' is a stray and dropped, except the last copy of
  a 'running' job on processing: that one belongs to the job's holder, and
  without it an expired lease could never be recovered. The id of a job
  cancelled while queued (state 'cancelled', see cancel.lua) is dropped
  with its hash: that is where a cancel takes effect.

  attempts, gen and max_attempts are read as whole numbers from 0 (1) to
  2^31 - 1 (the mirror's integer columns) whatever the hash holds, and
  attempts and gen are written back, so the token the fenced scripts compare
  always reads the same as the one returned.

  Returns: { jobs, dead, garbage, remaining }
    jobs      flat list: id, attempt, max_attempts, payload, gen, waited_ms
              (per job); attempt and gen together are the fencing token;
              waited_ms is how long the job was ready before this claim
              (see latency.lua), -1 when its hash holds no time
    dead      flat list: id, attempts, gen (jobs that had no attempt left)
    garbage   list of ids moved aside: no job hash, or a damaged one
    remaining length of queued after the claim
  Errors: count or lease_ms not a whole number from 0 to 2^52 (nothing is
  written).
]]
local queued_key = KEYS[1]
local processing_key = KEYS[2]
local leases_key = KEYS[3]
local dead_key = KEYS[4]
local wake_key = KEYS[5]
local job_prefix = KEYS[6]
local landing_key = KEYS[7]

-- A whole number from ARGV, or an error reply before anything is written.
local function whole(value, name)
  local n = tonumber(value)
  if n == nil or n ~= math.floor(n) or n < 0 or n > 4503599627370496 then
    error({ err = 'ERR claim: ' .. name .. ' must be a whole number from 0 to 2^52, not '
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

local KNOWN_STATES = {
  queued = true, running = true, scheduled = true, dead = true, finished = true, cancelled = true
}

local count = whole(ARGV[1], 'count')
local lease_ms = whole(ARGV[2], 'lease_ms')
local moved_id = ARGV[3] or ''

local clock = redis.call('TIME')
local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local deadline_ms = now_ms + lease_ms

local ids = {}
-- Stamping a moved id that is back on queued would leave a running job off
-- processing, out of recover's reach: only one still on landing is taken.
if moved_id ~= '' and redis.call('LREM', landing_key, 1, moved_id) > 0 then
  redis.call('LPUSH', processing_key, moved_id)
  ids[1] = moved_id
end
local wanted = count - #ids
if wanted > 0 then
  local taken = redis.call('LRANGE', queued_key, -wanted, -1)
  if #taken > 0 then
    redis.call('LTRIM', queued_key, 0, -#taken - 1)
    -- unpack() has a stack limit (about 8,000 values): push in chunks. A
    -- script that fails half-way is not rolled back.
    for i = 1, #taken, 1000 do
      redis.call('LPUSH', processing_key, unpack(taken, i, math.min(i + 999, #taken)))
    end
    for i = #taken, 1, -1 do
      ids[#ids + 1] = taken[i]
    end
  end
end

local jobs, dead, garbage, lease_args = {}, {}, {}, {}
for _, job_id in ipairs(ids) do
  local job_key = job_prefix .. job_id
  local job = redis.call('HMGET', job_key, 'state', 'attempts', 'max_attempts', 'payload', 'gen',
    'ready_ms', 'enqueued_ms')
  local gen = count_of(job[5], 0)
  if not KNOWN_STATES[job[1]] then
    -- No hash, or a damaged one: the database still has the job, and
    -- reconcile pushes it again once its hash is gone.
    redis.call('LREM', processing_key, 1, job_id)
    redis.call('DEL', job_key)
    redis.call('ZADD', dead_key, now_ms, job_id)
    garbage[#garbage + 1] = job_id
  elseif job[1] == 'cancelled' then
    redis.call('LREM', processing_key, 1, job_id)
    redis.call('DEL', job_key)
  elseif job[1] ~= 'queued' then
    -- A stray second copy of a job that lives elsewhere: drop this copy,
    -- unless it is the only copy of a running job on processing.
    if job[1] ~= 'running'
        or #redis.call('LPOS', processing_key, job_id, 'COUNT', 2) > 1 then
      redis.call('LREM', processing_key, 1, job_id)
    end
  else
    local attempts = count_of(job[2], 0)
    local max_attempts = count_of(job[3], 1)
    if attempts >= max_attempts then
      redis.call('LREM', processing_key, 1, job_id)
      redis.call('ZADD', dead_key, now_ms, job_id)
      redis.call('HSET', job_key, 'state', 'dead', 'finished_ms', now_ms, 'last_error',
        'reliable_jobs.exceptions.AttemptsExhausted: claimed ' .. attempts .. ' of ' .. max_attempts ..
        ' times without finishing (worker lost or lease expired)')
      dead[#dead + 1] = job_id
      dead[#dead + 1] = attempts
      dead[#dead + 1] = gen
    else
      attempts = attempts + 1
      redis.call('HSET', job_key, 'state', 'running', 'attempts', attempts, 'gen', gen,
        'started_ms', now_ms)
      lease_args[#lease_args + 1] = deadline_ms
      lease_args[#lease_args + 1] = job_id
      jobs[#jobs + 1] = job_id
      jobs[#jobs + 1] = attempts
      jobs[#jobs + 1] = max_attempts
      jobs[#jobs + 1] = job[4] or ''
      jobs[#jobs + 1] = gen
      local ready_ms = tonumber(job[6]) or tonumber(job[7])
      jobs[#jobs + 1] = ready_ms and math.max(0, now_ms - ready_ms) or -1
    end
  end
end
for i = 1, #lease_args, 1000 do
  redis.call('ZADD', leases_key, unpack(lease_args, i, math.min(i + 999, #lease_args)))
end

local remaining = redis.call('LLEN', queued_key)
if remaining > 0 and redis.call('LLEN', wake_key) == 0 then
  redis.call('RPUSH', wake_key, '1')
end
return { jobs, dead, garbage, remaining }
