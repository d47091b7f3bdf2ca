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

  Returns: a list with 1 (marked: run it) or 0 (refused: the attempt is no
  longer held, do not run it) per group.
]]
local job_prefix = KEYS[1]

--- @include "fence"

local results = {}
for i = 1, #ARGV, 3 do
  local job_id = ARGV[i]
  local job_key = job_prefix .. job_id
  local job = redis.call('HMGET', job_key, 'state', 'attempts', 'gen')
  if holds(job, ARGV[i + 1], ARGV[i + 2]) then
    redis.call('HSET', job_key, 'started', ARGV[i + 1])
    results[#results + 1] = 1
  else
    results[#results + 1] = 0
  end
end
return results
