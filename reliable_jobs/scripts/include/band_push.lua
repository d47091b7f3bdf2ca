--[[
  include band_push: put an id on the list of its priority band.

  push_band_behind(job_id, priority) queues it behind the jobs waiting (a
  retry, a promoted, requeued, revived or reprioritized job);
  push_band_next(job_id, priority) puts it where it runs next (a job recover
  or release gives back). Priority 0 is the queue's own list, queued_key; any
  other is band_prefix .. priority, listed in bands_key. The including script
  names those three keys as locals before the include line. Two functions
  rather than one taking the command: every redis.call names its command
  literally, so tests/test_scripts.py can check each key it touches.
]]
local function push_band_behind(job_id, priority)
  if priority == 0 then
    redis.call('LPUSH', queued_key, job_id)
  else
    redis.call('LPUSH', band_prefix .. priority, job_id)
    redis.call('ZADD', bands_key, priority, priority)
  end
end

local function push_band_next(job_id, priority)
  if priority == 0 then
    redis.call('RPUSH', queued_key, job_id)
  else
    redis.call('RPUSH', band_prefix .. priority, job_id)
    redis.call('ZADD', bands_key, priority, priority)
  end
end
