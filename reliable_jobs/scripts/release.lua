--[[
  release: on graceful shutdown, hand a worker's jobs straight back.

  KEYS[1] queued      list   ids ready to run (the oldest on the right)
  KEYS[2] leases      zset   id -> lease deadline (ms): the in-flight index
  KEYS[3] wake        list   at most one marker, pushed when work arrives
  KEYS[4] job prefix  string job hashes are KEYS[4] .. id (same {queue} slot)
  KEYS[5] bands       zset   non-zero priorities with a non-empty band list
  KEYS[6] band prefix string the list of priority p is KEYS[6] .. p
  KEYS[7] fair_bands  zset   priorities with fair groups waiting (see claim.lua)
  KEYS[8] rota prefix string the rotation of priority p is KEYS[8] .. p
  KEYS[9] group prefix string group g's list at priority p: KEYS[9] .. p .. ':' .. g

  ARGV, repeated in groups of four:
    id        job id
    attempt   the fencing token from claim, with gen
    gen       the job's generation (see enqueue.lua)
    started   1 if the task had started (interrupted), 0 if it never started

  Released jobs go on the right of queued, to run next. A job that never
  started gets its attempt back (max_attempts + 1: attempts itself never
  goes down, so a fencing token is never handed out twice), so a shutdown
  costs it nothing; an interrupted one keeps the attempt it used.

  A job marked for cancellation while it ran (field 'cancel', see
  cancel.lua) is not handed back: it is finished as cancelled (a
  'cancelled' tombstone for CANCELLED_TOMBSTONE_MS).

  Returns: a list with 1 (released), 2 (finished as cancelled instead) or
  0 (refused: stale attempt) per group.
  Errors: ARGV not in groups of four (nothing is written).
]]
local queued_key = KEYS[1]
local leases_key = KEYS[2]
local wake_key = KEYS[3]
local job_prefix = KEYS[4]
local bands_key = KEYS[5]
local band_prefix = KEYS[6]
local fair_bands_key = KEYS[7]
local rota_prefix = KEYS[8]
local group_prefix = KEYS[9]

--- @include "wake_marker"
--- @include "fence"

--- @include "read_job"

--- @include "band_of"

--- @include "band_push"

if #ARGV % 4 ~= 0 then
  return redis.error_reply(
    'ERR release: ARGV must come in groups of four (id, attempt, gen, started)')
end

-- max_attempts is read with count_of, not HINCRBY: on a damaged value
-- HINCRBY would fail half-way through this script, leaving the job off
-- every list.
--- @include "count_of"

--- @include "tombstone"

local results = {}
local released = 0
for i = 1, #ARGV, 4 do
  local job_id = ARGV[i]
  local job_key = job_prefix .. job_id
  local job = read_job(job_id, 'state', 'attempts', 'gen', 'cancel', 'priority', 'fair')
  if holds(job, ARGV[i + 1], ARGV[i + 2])
      and job[4] then
    redis.call('ZREM', leases_key, job_id)
    leave_tombstone(job_id, 'cancelled', job[3] or '0', CANCELLED_TOMBSTONE_MS)
    results[#results + 1] = 2
  elseif holds(job, ARGV[i + 1], ARGV[i + 2]) then
    redis.call('ZREM', leases_key, job_id)
    if ARGV[i + 3] == '0' then
      local max_attempts = count_of(redis.call('HGET', job_key, 'max_attempts'), 1)
      redis.call('HSET', job_key, 'state', 'queued',
        'max_attempts', math.min(max_attempts + 1, MAX_COUNT))
    else
      redis.call('HSET', job_key, 'state', 'queued')
    end
    push_band_next(job_id, band_of(job[5]), group_of(job[6]))
    released = released + 1
    results[#results + 1] = 1
  else
    results[#results + 1] = 0
  end
end
if released > 0 then
  push_wake_marker(wake_key)
end
return results
