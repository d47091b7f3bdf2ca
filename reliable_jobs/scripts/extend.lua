--[[
  extend: push the lease deadline of running jobs forward, fenced.

  KEYS[1] leases      zset   id -> lease deadline (ms, server clock)
  KEYS[2] job prefix  string job hashes are KEYS[2] .. id (same {queue} slot)

  ARGV[1] lease_ms   new lease length from now, in milliseconds
  ARGV[2..]          groups of three: id, attempt, gen (the fencing token
                     from claim)

  A renewal from a worker that no longer holds the attempt (its lease
  expired and the job was recovered or claimed again) is refused, and the
  lease it would have extended is left alone.

  The reply also carries a cancel request (see cancel.lua) back to the
  holder, so a worker learns of it without a round trip of its own: the
  lease is still extended (the holder is alive, stopping its task), and
  the script that ends the attempt finishes the job as cancelled.

  Returns: a list with 1 (extended), 2 (extended; the job is to be
  cancelled) or 0 (refused) per group.
  Errors: lease_ms not a whole number from 0 to 2^52 (nothing is written).
]]
local leases_key = KEYS[1]
local job_prefix = KEYS[2]

--- @include "fence"

--- @include "read_job"
--- @include "server_clock"

local now = now_ms()
local lease_ms = tonumber(ARGV[1])
if lease_ms == nil or lease_ms ~= math.floor(lease_ms) or lease_ms < 0
    or lease_ms > 4503599627370496 then
  return redis.error_reply('ERR extend: lease_ms must be a whole number from 0 to 2^52')
end
local deadline_ms = now + lease_ms

local results = {}
for i = 2, #ARGV, 3 do
  local job_id = ARGV[i]
  local job = read_job(job_id, 'state', 'attempts', 'gen', 'cancel')
  if holds(job, ARGV[i + 1], ARGV[i + 2])
      and redis.call('ZSCORE', leases_key, job_id) then
    redis.call('ZADD', leases_key, deadline_ms, job_id)
    if job[4] then
      results[#results + 1] = 2
    else
      results[#results + 1] = 1
    end
  else
    results[#results + 1] = 0
  end
end
return results
