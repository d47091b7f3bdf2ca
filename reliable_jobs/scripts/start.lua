--[[
  start: record that attempts are about to run their task, fenced.

  KEYS[1] job prefix  string job hashes are KEYS[1] .. id (same {queue} slot)

  ARGV, repeated in groups of three: id, attempt, gen (the fencing token
  from claim)

  A worker claims a batch but starts each job later. The mark, written
  before the task runs, tells recover which claims really ran: an expired
  claim whose attempt never started is given its attempt back, so the
  neighbours of a job that crashes its worker are not charged for it, while
  the crashing job, marked before it ran, still is (G3).

  A claim marked for cancellation before it started (field 'cancel', see
  cancel.lua) is not marked: its task must not run, and its holder
  finishes it as cancelled (ack.lua).

  Returns: a list with 1 (marked: run it), 2 (held, but cancelled: do not
  run it, finish it) or 0 (refused: the attempt is no longer held, do not
  run it) per group.
]]
local job_prefix = KEYS[1]

--- @include "fence"

--- @include "read_job"

local results = {}
for i = 1, #ARGV, 3 do
  local job_id = ARGV[i]
  local job_key = job_prefix .. job_id
  local job = read_job(job_id, 'state', 'attempts', 'gen', 'cancel')
  if holds(job, ARGV[i + 1], ARGV[i + 2]) and job[4] then
    results[#results + 1] = 2
  elseif holds(job, ARGV[i + 1], ARGV[i + 2]) then
    redis.call('HSET', job_key, 'started', ARGV[i + 1])
    results[#results + 1] = 1
  else
    results[#results + 1] = 0
  end
end
return results
