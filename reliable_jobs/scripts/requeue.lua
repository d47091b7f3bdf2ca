--[[
  requeue: run a scheduled job now instead of at its due time (a staff action).

  KEYS[1] queued      list   ids ready to run (producers push on the left)
  KEYS[2] scheduled   zset   id -> due time (ms)
  KEYS[3] wake        list   at most one marker, pushed when work arrives
  KEYS[4] job prefix  string job hashes are KEYS[4] .. id (same {queue} slot)
  KEYS[5] bands       zset   non-zero priorities with a non-empty band list
  KEYS[6] band prefix string the list of priority p is KEYS[6] .. p
  KEYS[7] fair_bands  zset   priorities with fair groups waiting (see claim.lua)
  KEYS[8] rota prefix string the rotation of priority p is KEYS[8] .. p
  KEYS[9] group prefix string group g's list at priority p: KEYS[9] .. p .. ':' .. g

  ARGV[1] id  job id

  Only a job Redis holds as 'scheduled' (a run_after or a retry delay) moves;
  any other state is reported and left alone, so a job already queued or
  running is never pushed twice. The job's 'ready_ms' becomes now (see
  latency.lua).

  Returns: { moved (1 or 0), state found ('' when no hash) }
]]
local queued_key = KEYS[1]
local scheduled_key = KEYS[2]
local wake_key = KEYS[3]
local job_prefix = KEYS[4]
local bands_key = KEYS[5]
local band_prefix = KEYS[6]
local fair_bands_key = KEYS[7]
local rota_prefix = KEYS[8]
local group_prefix = KEYS[9]

--- @include "wake_marker"

--- @include "band_of"

--- @include "band_push"

--- @include "server_clock"

--- @include "read_job"

local job_id = ARGV[1]
local job_key = job_prefix .. job_id
local state = read_job(job_id, 'state')[1] or ''
if state ~= 'scheduled' or redis.call('ZREM', scheduled_key, job_id) == 0 then
  return { 0, state }
end
redis.call('HSET', job_key, 'state', 'queued', 'ready_ms', now_ms())
push_band_behind(job_id, band_of(redis.call('HGET', job_key, 'priority')),
  group_of(redis.call('HGET', job_key, 'fair')))
push_wake_marker(wake_key)
return { 1, state }
