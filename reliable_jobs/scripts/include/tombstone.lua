--[[
  include tombstone: leave_tombstone(job_id, state, gen, ttl_ms), and how
  long a cancelled job's tombstone lives.

  A tombstone is a job hash cut down to its state ('finished' or
  'cancelled') and generation, expiring after ttl_ms: while it lives,
  enqueue.lua refuses a push of the same or an older generation (a late
  on-commit push), so the job never runs again. The including script names
  job_prefix as a local before the include line.
]]
-- How long a cancelled job's tombstone lives, in milliseconds (an hour,
-- broker.TOMBSTONE_MS), in the scripts the broker passes no tombstone_ms
-- (claim, nack, release; cancel when its argument is not a whole number).
local CANCELLED_TOMBSTONE_MS = 3600000

local function leave_tombstone(job_id, state, gen, ttl_ms)
  redis.call('DEL', job_prefix .. job_id)
  redis.call('HSET', job_prefix .. job_id, 'state', state, 'gen', gen)
  redis.call('PEXPIRE', job_prefix .. job_id, ttl_ms)
end
