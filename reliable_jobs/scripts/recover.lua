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

  Safe to run concurrently with itself, workers and other sweeps: each step
  is one atomic script, and an id is acted on only if LREM found it.

  Returns: { outcomes, stamped }
    outcomes  flat list: id, attempts, max_attempts, kind per handled lease,
              where kind is 'expired' (requeued), 'unstarted' (requeued,
              refunded), 'dead', 'orphan' (requeued, never claimed),
              'garbage' (no job hash) or 'dropped' (stray copy)
    stamped   how many orphans got a first lease
]]
local queued_key = KEYS[1]
local processing_key = KEYS[2]
local leases_key = KEYS[3]
local dead_key = KEYS[4]
local wake_key = KEYS[5]
local job_prefix = KEYS[6]

local limit = tonumber(ARGV[1])
local lease_ms = tonumber(ARGV[2])
local orphan_scan = tonumber(ARGV[3])

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
    local attempts = tonumber(job[2]) or 0
    local max_attempts = tonumber(job[3]) or 1
    local kind
    if not job[1] then
      kind = 'garbage'
      redis.call('ZADD', dead_key, now_ms, job_id)
    elseif job[1] == 'running' and job[4] ~= job[2] then
      kind = 'unstarted'
      max_attempts = max_attempts + 1
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
