--[[
  promote: move due jobs from scheduled to queued.

  KEYS[1] queued      list   ids ready to run (producers push on the left)
  KEYS[2] scheduled   zset   id -> due time (ms, server clock)
  KEYS[3] wake        list   at most one marker, pushed when work arrives
  KEYS[4] job prefix  string job hashes are KEYS[4] .. id (same {queue} slot)
  KEYS[5] bands       zset   non-zero priorities with a non-empty band list
  KEYS[6] band prefix string the list of priority p is KEYS[6] .. p
  KEYS[7] fair_bands  zset   priorities with fair groups waiting (see claim.lua)
  KEYS[8] rota prefix string the rotation of priority p is KEYS[8] .. p
  KEYS[9] group prefix string group g's list at priority p: KEYS[9] .. p .. ':' .. g

  ARGV[1] limit  jobs promoted per call at most

  A due job goes on the list of its priority (its hash's 'priority'; 0, on
  queued, when there is none), behind the jobs already waiting there.

  An id whose hash is gone or not 'scheduled' (cancelled, or a stray) is
  dropped from scheduled; the database reconcile restores a real job that
  Redis lost. A damaged hash (no state, or a state no script writes) is
  deleted as well, so that reconcile rebuilds that job too. A promoted job's
  hash gets 'ready_ms' (now), from which latency.lua measures its wait.

  Returns: the number of jobs promoted.
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

local now = now_ms()

local KNOWN_STATES = {
  queued = true, running = true, scheduled = true, dead = true, finished = true, cancelled = true
}

local due = redis.call('ZRANGEBYSCORE', scheduled_key, '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
local ready = {}
local banded = 0
for _, job_id in ipairs(due) do
  redis.call('ZREM', scheduled_key, job_id)
  local job_key = job_prefix .. job_id
  local found = read_job(job_id, 'state', 'priority', 'fair')
  local state = found[1]
  if state == 'scheduled' then
    redis.call('HSET', job_key, 'state', 'queued', 'ready_ms', now)
    local priority = band_of(found[2])
    local group = group_of(found[3])
    if priority == 0 and group == '' then
      ready[#ready + 1] = job_id
    else
      push_band_behind(job_id, priority, group)
      banded = banded + 1
    end
  elseif not KNOWN_STATES[state] then
    redis.call('DEL', job_key)
  end
end
for i = 1, #ready, 1000 do
  redis.call('LPUSH', queued_key, unpack(ready, i, math.min(i + 999, #ready)))
end
if #ready > 0 then
  plain_joined(0)
end
if #ready + banded > 0 then
  push_wake_marker(wake_key)
end
return #ready + banded
