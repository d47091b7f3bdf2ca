--[[
  include band_push: put an id on the list of its priority band, or of its
  fair group within that band.

  push_band_behind(job_id, priority, group) queues it behind the jobs
  waiting (a retry, a promoted, requeued, revived or reprioritized job);
  push_band_next(job_id, priority, group) puts it where it runs next (a job
  recover or release gives back). Priority 0 is the queue's own list,
  queued_key; any other is band_prefix .. priority, listed in bands_key.

  A job with a fair group (group_of its hash's 'fair' field, not '') waits
  on its group's list at its priority, group_prefix .. priority .. ':' ..
  group, and the group is in that priority's rotation, rota_prefix ..
  priority (a zset group -> its place in the turn order; see claim.lua),
  which is listed in fair_bands_key while not empty. While a priority has a
  rotation, the member '' stands in it for the priority's plain list
  whenever that list has jobs, so jobs without a group take turns too; a
  priority without a rotation costs one ZSCORE per push and nothing else.

  The including script names queued_key, band_prefix, bands_key,
  fair_bands_key, rota_prefix and group_prefix as locals before the include
  line. Two functions rather than one taking the command: every redis.call
  names its command literally, so tests/test_scripts.py can check each key
  it touches.
]]
-- A job's fair group as its hash holds it: '' for none (or a damaged field).
local function group_of(value)
  if type(value) ~= 'string' then
    return ''
  end
  return value
end

-- Put group (or '' for the plain list) at the back of priority's turn order,
-- unless it is in it already. The first group of a priority whose plain
-- list already holds jobs puts '' ahead of itself: those jobs came first.
local function join_rota(priority, group)
  if redis.call('ZSCORE', rota_prefix .. priority, group) then
    return
  end
  local last = redis.call('ZRANGE', rota_prefix .. priority, -1, -1, 'WITHSCORES')
  local place = 0
  if #last == 0 then
    redis.call('ZADD', fair_bands_key, priority, priority)
    local plain
    if priority == 0 then
      plain = redis.call('LLEN', queued_key)
    else
      plain = redis.call('LLEN', band_prefix .. priority)
    end
    if group ~= '' and plain > 0 then
      redis.call('ZADD', rota_prefix .. priority, 0, '')
      place = 1
    end
  else
    place = tonumber(last[2]) + 1
  end
  redis.call('ZADD', rota_prefix .. priority, place, group)
end

-- After a push onto priority's plain list: give it a turn if the priority
-- has a rotation.
local function plain_joined(priority)
  if redis.call('ZSCORE', fair_bands_key, priority) then
    join_rota(priority, '')
  end
end

local function push_band_behind(job_id, priority, group)
  if group ~= '' then
    local member = priority .. ':' .. group
    redis.call('LPUSH', group_prefix .. member, job_id)
    join_rota(priority, group)
  elseif priority == 0 then
    redis.call('LPUSH', queued_key, job_id)
    plain_joined(0)
  else
    redis.call('LPUSH', band_prefix .. priority, job_id)
    plain_joined(priority)
  end
  if priority ~= 0 then
    redis.call('ZADD', bands_key, priority, priority)
  end
end

local function push_band_next(job_id, priority, group)
  if group ~= '' then
    local member = priority .. ':' .. group
    redis.call('RPUSH', group_prefix .. member, job_id)
    join_rota(priority, group)
  elseif priority == 0 then
    redis.call('RPUSH', queued_key, job_id)
    plain_joined(0)
  else
    redis.call('RPUSH', band_prefix .. priority, job_id)
    plain_joined(priority)
  end
  if priority ~= 0 then
    redis.call('ZADD', bands_key, priority, priority)
  end
end
