--[[
  ack: finish jobs that succeeded, fenced by attempt number.

  KEYS[1] processing  list   ids claimed and not yet acked
  KEYS[2] leases      zset   id -> lease deadline (ms)
  KEYS[3] job prefix  string job hashes are KEYS[3] .. id (same {queue} slot)

  ARGV, repeated in pairs: id, attempt (the fencing token from claim)

  Only the current holder may ack: the job must be 'running' with exactly
  that attempt number, or the ack is refused (a stale worker whose lease
  expired cannot complete a job someone else now holds). The hash is freed:
  the history lives in the database mirror, which is written before the ack.

  Returns: a list with 1 (acked) or 0 (refused) per pair.
]]
local processing_key = KEYS[1]
local leases_key = KEYS[2]
local job_prefix = KEYS[3]

local results, done_ids, done_keys = {}, {}, {}
for i = 1, #ARGV, 2 do
  local job_id = ARGV[i]
  local job_key = job_prefix .. job_id
  local job = redis.call('HMGET', job_key, 'state', 'attempts')
  if job[1] == 'running' and job[2] == ARGV[i + 1] then
    -- Claimed ids sit near the tail of processing: search from there.
    redis.call('LREM', processing_key, -1, job_id)
    done_ids[#done_ids + 1] = job_id
    done_keys[#done_keys + 1] = job_key
    results[#results + 1] = 1
  else
    results[#results + 1] = 0
  end
end
-- unpack() has a stack limit (about 8,000 values): work in chunks. A script
-- that fails half-way is not rolled back.
for i = 1, #done_ids, 1000 do
  local last = math.min(i + 999, #done_ids)
  redis.call('ZREM', leases_key, unpack(done_ids, i, last))
  redis.call('DEL', unpack(done_keys, i, last))
end
return results
