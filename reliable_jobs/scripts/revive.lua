--[[
  revive: give a dead job a fresh attempt budget and queue it again.

  KEYS[1] queued      list   ids ready to run
  KEYS[2] dead        zset   id -> time of death (ms)
  KEYS[3] wake        list   at most one marker, pushed when work arrives
  KEYS[4] job prefix  string job hashes are KEYS[4] .. id (same {queue} slot)
  KEYS[5] bands       zset   non-zero priorities with a non-empty band list
  KEYS[6] band prefix string the list of priority p is KEYS[6] .. p
  KEYS[7] fair_bands  zset   priorities with fair groups waiting (see claim.lua)
  KEYS[8] rota prefix string the rotation of priority p is KEYS[8] .. p
  KEYS[9] group prefix string group g's list at priority p: KEYS[9] .. p .. ':' .. g

  ARGV[1] id             job id
  ARGV[2] extra_attempts attempts added on top of those already spent

  The attempts counter keeps counting (so fencing tokens never repeat and
  the history keeps every attempt); max_attempts becomes attempts + extra.
  The job's 'ready_ms' becomes now (see latency.lua).

  Returns: 1 if revived, 0 if the job was not dead in Redis.
  Errors: extra_attempts not a whole number from 0 to 2^31 - 1 (nothing is
  written).
]]
local queued_key = KEYS[1]
local dead_key = KEYS[2]
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

local MAX_COUNT = 2147483647
local extra = tonumber(ARGV[2])
if extra == nil or extra ~= math.floor(extra) or extra < 0 or extra > MAX_COUNT then
  return redis.error_reply('ERR revive: extra_attempts must be a whole number from 0 to 2^31 - 1')
end

local job_id = ARGV[1]
local job_key = job_prefix .. job_id
if read_job(job_id, 'state')[1] ~= 'dead' then
  return 0
end
-- The counter as claim reads it (a whole number within the mirror's range).
local attempts = tonumber(redis.call('HGET', job_key, 'attempts'))
if attempts == nil or attempts ~= attempts then
  attempts = 0
end
attempts = math.max(0, math.min(MAX_COUNT, math.floor(attempts)))
redis.call('ZREM', dead_key, job_id)
redis.call('HSET', job_key, 'state', 'queued', 'max_attempts', math.min(attempts + extra, MAX_COUNT),
  'ready_ms', now_ms())
redis.call('HDEL', job_key, 'finished_ms')
push_band_behind(job_id, band_of(redis.call('HGET', job_key, 'priority')),
  group_of(redis.call('HGET', job_key, 'fair')))
push_wake_marker(wake_key)
return 1
