--[[
  reprioritize: change the priority of a job that waits (a staff action).

  KEYS[1] queued      list   ids ready to run at priority 0
  KEYS[2] wake        list   at most one marker, pushed when work arrives
  KEYS[3] job prefix  string job hashes are KEYS[3] .. id (same {queue} slot)
  KEYS[4] bands       zset   non-zero priorities with a non-empty band list
  KEYS[5] band prefix string the list of priority p is KEYS[5] .. p
  KEYS[6] strays      zset   id -> copies left behind on a band list
  KEYS[7] fair_bands  zset   priorities with fair groups waiting (see claim.lua)
  KEYS[8] rota prefix string the rotation of priority p is KEYS[8] .. p
  KEYS[9] group prefix string group g's list at priority p: KEYS[9] .. p .. ':' .. g

  ARGV[1] id        job id
  ARGV[2] priority  the new priority, a whole number from -100 to 100

  A scheduled job only has its hash's priority changed: promote.lua puts it
  on the new band when it is due. A queued job is pushed on the left of its
  new band's list (behind the jobs already waiting at that priority, as if
  enqueued now) and its hash says the new priority. Its old copy is not
  searched for on the old band's list (LREM over a long list is O(n)): it is
  counted in strays, and claim.lua drops it when it reaches it (a 'queued'
  job found on another band than its priority's, or an id with no hash
  that strays counts), as cancel.lua leaves a cancelled id for claim to
  drop. Any other state (running, dead, finished, cancelled) is left alone
  and reported: a job already claimed is never pushed twice.

  Returns: { changed (1 or 0), state found ('' when no hash), old priority }
  Errors: priority not a whole number from -100 to 100 (nothing is written).
]]
local queued_key = KEYS[1]
local wake_key = KEYS[2]
local job_prefix = KEYS[3]
local bands_key = KEYS[4]
local band_prefix = KEYS[5]
local strays_key = KEYS[6]
local fair_bands_key = KEYS[7]
local rota_prefix = KEYS[8]
local group_prefix = KEYS[9]

--- @include "wake_marker"

local priority = tonumber(ARGV[2])
if priority == nil or priority ~= math.floor(priority) or priority < -100 or priority > 100 then
  return redis.error_reply('ERR reprioritize: priority must be a whole number from -100 to 100, not '
    .. string.sub(tostring(ARGV[2]), 1, 40))
end

--- @include "band_of"
--- @include "band_push"

--- @include "read_job"

local job_id = ARGV[1]
local job_key = job_prefix .. job_id
local found = read_job(job_id, 'state', 'priority', 'fair')
local state = found[1] or ''
local old = band_of(found[2])
if (state ~= 'queued' and state ~= 'scheduled') or old == priority then
  return { 0, state, old }
end
if priority == 0 then
  redis.call('HDEL', job_key, 'priority')
else
  redis.call('HSET', job_key, 'priority', priority)
end
if state == 'queued' then
  push_band_behind(job_id, priority, group_of(found[3]))
  redis.call('ZINCRBY', strays_key, 1, job_id)
  push_wake_marker(wake_key)
end
return { 1, state, old }
