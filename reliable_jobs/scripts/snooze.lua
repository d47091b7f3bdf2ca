--[[
  snooze: a job's task asked to run again later (Snooze); give its attempt back, fenced.

  KEYS[1] queued      list   ids ready to run
  KEYS[2] leases      zset   id -> lease deadline (ms): the in-flight index
  KEYS[3] scheduled   zset   id -> due time (ms)
  KEYS[4] wake        list   at most one marker, pushed when work arrives
  KEYS[5] job prefix  string job hashes are KEYS[5] .. id (same {queue} slot)
  KEYS[6] bands       zset   non-zero priorities with a non-empty band list
  KEYS[7] band prefix string the list of priority p is KEYS[7] .. p
  KEYS[8] fair_bands  zset   priorities with fair groups waiting (see claim.lua)
  KEYS[9] rota prefix string the rotation of priority p is KEYS[9] .. p
  KEYS[10] group prefix string group g's list at priority p: KEYS[10] .. p .. ':' .. g

  ARGV, repeated in groups of four, one per snoozed attempt:
    id        job id
    attempt   the fencing token from claim, with gen
    gen       the job's generation (see enqueue.lua)
    delay_ms  run again after this many ms (0: queue at once)

  Like nack's retry, but the attempt is given back: max_attempts + 1, as
  release gives back a claim that never started (attempts itself never goes
  down: it is the fencing token, and a token is never handed out twice). So
  a job may snooze any number of times without using up its attempts. The
  due time is computed here from TIME (one clock). Only the holder may
  snooze: a stale worker's snooze (its lease lost, the job claimed again or
  recovered) is refused and changes nothing.

  A delay that is not a whole number >= 0 counts as 0; one beyond 2^52 ms is
  cut to 2^52 ms.

  A job marked for cancellation while it ran (field 'cancel', see
  cancel.lua) does not wait again: it is finished as cancelled (a
  'cancelled' tombstone for CANCELLED_TOMBSTONE_MS).

  Returns: a list with 1 (snoozed), 2 (finished as cancelled instead) or 0
  (refused: stale attempt) per group.
  Errors: ARGV not in groups of four (nothing is written).
]]
local queued_key = KEYS[1]
local leases_key = KEYS[2]
local scheduled_key = KEYS[3]
local wake_key = KEYS[4]
local job_prefix = KEYS[5]
local bands_key = KEYS[6]
local band_prefix = KEYS[7]
local fair_bands_key = KEYS[8]
local rota_prefix = KEYS[9]
local group_prefix = KEYS[10]

--- @include "wake_marker"
--- @include "fence"

--- @include "read_job"

--- @include "band_of"

--- @include "band_push"

if #ARGV % 4 ~= 0 then
  return redis.error_reply(
    'ERR snooze: ARGV must come in groups of four (id, attempt, gen, delay_ms)')
end

--- @include "count_of"

--- @include "tombstone"

--- @include "server_clock"

local function delay_of(value)
  local n = tonumber(value)
  if n == nil or n ~= n or n < 0 then
    return 0
  end
  return math.min(math.floor(n), 4503599627370496)
end

local now = now_ms()
local results = {}
local queued_now = 0
for i = 1, #ARGV, 4 do
  local job_id = ARGV[i]
  local job_key = job_prefix .. job_id
  local delay_ms = delay_of(ARGV[i + 3])
  local job = read_job(job_id, 'state', 'attempts', 'gen', 'cancel', 'priority', 'fair',
    'max_attempts')
  if holds(job, ARGV[i + 1], ARGV[i + 2]) then
    redis.call('ZREM', leases_key, job_id)
    if job[4] then
      leave_tombstone(job_id, 'cancelled', job[3] or '0', CANCELLED_TOMBSTONE_MS)
      results[#results + 1] = 2
    else
      local budget = math.min(count_of(job[7], 1) + 1, MAX_COUNT)
      if delay_ms == 0 then
        push_band_behind(job_id, band_of(job[5]), group_of(job[6]))
        redis.call('HSET', job_key, 'state', 'queued', 'max_attempts', budget, 'ready_ms', now)
        queued_now = queued_now + 1
      else
        redis.call('ZADD', scheduled_key, now + delay_ms, job_id)
        redis.call('HSET', job_key, 'state', 'scheduled', 'max_attempts', budget)
      end
      results[#results + 1] = 1
    end
  else
    results[#results + 1] = 0
  end
end
if queued_now > 0 then
  push_wake_marker(wake_key)
end
return results
