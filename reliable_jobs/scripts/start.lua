--[[
  start: record that attempts are about to run their task, fenced.

  KEYS[1] leases      zset   id -> lease deadline (ms, server clock)
  KEYS[2] job prefix  string job hashes are KEYS[2] .. id (same {queue} slot)
  KEYS[3] paused      string set while the queue is paused (pause.lua)

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

  A claim whose lease has expired (its deadline, on this server's clock, is
  not in the future) is not marked either: the sweep may be requeuing it for
  another worker at this moment, and a task started now could run beside
  that one. Its holder lets go of it; the sweep requeues it as a claim that
  never started. A claim with no lease at all is not held (as in extend).

  A claim whose queue was paused since (KEYS[3] exists) is not marked:
  the claim may have run just before the pause, and a pause promises that
  no attempt starts after it returned. Its holder hands it back unstarted
  (release.lua gives the attempt back); running jobs are not touched.

  Returns: a list with 1 (marked: run it), 2 (held, but cancelled: do not
  run it, finish it), 3 (held, but its lease expired: do not run it, leave
  it to the sweep), 4 (held, but the queue is paused: do not run it, hand
  it back) or 0 (refused: the attempt is no longer held, do not run it)
  per group.
]]
local leases_key = KEYS[1]
local job_prefix = KEYS[2]
local paused_key = KEYS[3]
local paused = redis.call('EXISTS', paused_key) == 1

--- @include "fence"

--- @include "read_job"

--- @include "server_clock"

local now = now_ms()
local results = {}
for i = 1, #ARGV, 3 do
  local job_id = ARGV[i]
  local job = read_job(job_id, 'state', 'attempts', 'gen', 'cancel')
  local deadline = nil
  if holds(job, ARGV[i + 1], ARGV[i + 2]) then
    deadline = tonumber(redis.call('ZSCORE', leases_key, job_id))
  end
  if deadline == nil then
    results[#results + 1] = 0
  elseif job[4] then
    results[#results + 1] = 2
  elseif deadline <= now then
    results[#results + 1] = 3
  elseif paused then
    results[#results + 1] = 4
  else
    redis.call('HSET', job_prefix .. job_id, 'started', ARGV[i + 1])
    results[#results + 1] = 1
  end
end
return results
