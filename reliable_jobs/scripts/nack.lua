--[[
  nack: a job's attempt failed; retry it later or bury it, fenced.

  KEYS[1] queued      list   ids ready to run
  KEYS[2] leases      zset   id -> lease deadline (ms): the in-flight index
  KEYS[3] scheduled   zset   id -> due time (ms)
  KEYS[4] dead        zset   id -> time of death (ms)
  KEYS[5] wake        list   at most one marker, pushed when work arrives
  KEYS[6] job prefix  string job hashes are KEYS[6] .. id (same {queue} slot)
  KEYS[7] bands       zset   non-zero priorities with a non-empty band list
  KEYS[8] band prefix string the list of priority p is KEYS[8] .. p
  KEYS[9] fair_bands  zset   priorities with fair groups waiting (see claim.lua)
  KEYS[10] rota prefix string the rotation of priority p is KEYS[10] .. p
  KEYS[11] group prefix string group g's list at priority p: KEYS[11] .. p .. ':' .. g

  ARGV, repeated in groups of five, one per failed attempt:
    id        job id
    attempt   the fencing token from claim, with gen
    gen       the job's generation (see enqueue.lua)
    delay_ms  retry after this many ms (0: queue at once); -1: the job is dead
    error     the error text kept in last_error

  The worker decides retry or dead (it knows attempts, max_attempts and
  whether the error is retryable); this script applies that decision only if
  the caller still holds the job, and computes the due time from TIME.

  A delay that is not a number counts as -1 (dead); one beyond 2^52 ms is
  cut to 2^52 ms (a job due in some 140,000 years, still in scheduled).

  A job marked for cancellation while it ran (field 'cancel', see
  cancel.lua) is neither retried nor buried: it is finished as cancelled
  (a 'cancelled' tombstone for CANCELLED_TOMBSTONE_MS).

  Returns: a list with 1 (applied), 2 (finished as cancelled instead) or 0
  (refused: stale attempt) per group.
  Errors: ARGV not in groups of five (nothing is written).
]]
local queued_key = KEYS[1]
local leases_key = KEYS[2]
local scheduled_key = KEYS[3]
local dead_key = KEYS[4]
local wake_key = KEYS[5]
local job_prefix = KEYS[6]
local bands_key = KEYS[7]
local band_prefix = KEYS[8]
local fair_bands_key = KEYS[9]
local rota_prefix = KEYS[10]
local group_prefix = KEYS[11]

--- @include "wake_marker"
--- @include "fence"

--- @include "read_job"

--- @include "band_of"

--- @include "band_push"

if #ARGV % 5 ~= 0 then
  return redis.error_reply(
    'ERR nack: ARGV must come in groups of five (id, attempt, gen, delay_ms, error)')
end

-- The delay decided by the worker (task code may pick it): -1 for dead.
local function delay_of(value)
  local n = tonumber(value)
  if n == nil or n ~= n or n < 0 then
    return -1
  end
  return math.min(math.floor(n), 4503599627370496)
end

--- @include "tombstone"

--- @include "server_clock"

local now = now_ms()

local results = {}
local queued_now = 0
for i = 1, #ARGV, 5 do
  local job_id = ARGV[i]
  local job_key = job_prefix .. job_id
  local delay_ms = delay_of(ARGV[i + 3])
  local error_text = ARGV[i + 4]
  local job = read_job(job_id, 'state', 'attempts', 'gen', 'cancel', 'priority', 'fair')
  if holds(job, ARGV[i + 1], ARGV[i + 2]) then
    redis.call('ZREM', leases_key, job_id)
    if job[4] then
      leave_tombstone(job_id, 'cancelled', job[3] or '0', CANCELLED_TOMBSTONE_MS)
    elseif delay_ms < 0 then
      redis.call('ZADD', dead_key, now, job_id)
      redis.call('HSET', job_key, 'state', 'dead', 'finished_ms', now, 'last_error', error_text)
    elseif delay_ms == 0 then
      push_band_behind(job_id, band_of(job[5]), group_of(job[6]))
      redis.call('HSET', job_key, 'state', 'queued', 'last_error', error_text)
      queued_now = queued_now + 1
    else
      redis.call('ZADD', scheduled_key, now + delay_ms, job_id)
      redis.call('HSET', job_key, 'state', 'scheduled', 'last_error', error_text)
    end
    results[#results + 1] = job[4] and 2 or 1
  else
    results[#results + 1] = 0
  end
end
if queued_now > 0 then
  push_wake_marker(wake_key)
end
return results
