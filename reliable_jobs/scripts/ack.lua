--[[
  ack: finish jobs that succeeded, fenced by attempt number.

  KEYS[1] leases      zset   id -> lease deadline (ms): the in-flight index
  KEYS[2] job prefix  string job hashes are KEYS[2] .. id (same {queue} slot)

  ARGV[1]  tombstone_ms  how long a finished rebuilt job's tombstone lives
  ARGV[2..] repeated in groups of three: id, attempt, gen (the fencing token
           from claim)

  Only the current holder may ack: the job must be 'running' with exactly
  that attempt number and generation, or the ack is refused (a stale worker
  whose lease expired, or who held the job before Redis lost it and it was
  rebuilt, cannot complete a job someone else now holds). Its id leaves the
  leases set (the in-flight index: O(log n) whatever the jobs in flight,
  batched in one ZREM per 1,000 ids). The hash is freed:
  the history lives in the database mirror, which is written before the ack.
  A job rebuilt from the mirror (gen > 0) leaves a tombstone instead, state
  'finished' for tombstone_ms: a late push of it from before the rebuild (an
  on-commit push that lost a race with reconcile) is refused by enqueue.lua
  instead of running the job again.

  A job marked for cancellation while it ran (field 'cancel', see
  cancel.lua) is finished as cancelled instead: the same removal, and a
  'cancelled' tombstone for tombstone_ms. The mirror, written first, holds
  its outcome (a staff cancel turned the row 'cancelled' before the mark).

  Returns: a list with 1 (acked), 2 (finished as cancelled) or 0 (refused)
  per group.
  Errors: tombstone_ms not a whole number from 1 to 2^52 (nothing is written).
]]
local leases_key = KEYS[1]
local job_prefix = KEYS[2]

--- @include "fence"

--- @include "read_job"

--- @include "tombstone"

local tombstone_ms = tonumber(ARGV[1])
if tombstone_ms == nil or tombstone_ms ~= math.floor(tombstone_ms) or tombstone_ms < 1
    or tombstone_ms > 4503599627370496 then
  return redis.error_reply('ERR ack: tombstone_ms must be a whole number from 1 to 2^52')
end

local results, done_ids, done_keys = {}, {}, {}
for i = 2, #ARGV, 3 do
  local job_id = ARGV[i]
  local job_key = job_prefix .. job_id
  local job = read_job(job_id, 'state', 'attempts', 'gen', 'cancel')
  local gen = job[3] or '0'
  if holds(job, ARGV[i + 1], ARGV[i + 2]) then
    done_ids[#done_ids + 1] = job_id
    if job[4] then
      -- Marked for cancellation while it ran: finished as cancelled.
      leave_tombstone(job_id, 'cancelled', gen, tombstone_ms)
      results[#results + 1] = 2
    elseif gen == '0' then
      done_keys[#done_keys + 1] = job_key
      results[#results + 1] = 1
    else
      leave_tombstone(job_id, 'finished', gen, tombstone_ms)
      results[#results + 1] = 1
    end
  else
    results[#results + 1] = 0
  end
end
-- unpack() has a stack limit (about 8,000 values): work in chunks. A script
-- that fails half-way is not rolled back.
for i = 1, #done_ids, 1000 do
  local last = math.min(i + 999, #done_ids)
  redis.call('ZREM', leases_key, unpack(done_ids, i, last))
end
for i = 1, #done_keys, 1000 do
  redis.call('DEL', unpack(done_keys, i, math.min(i + 999, #done_keys)))
end
return results
