--[[
  cancel: take a waiting job off queued or scheduled; ask a running one to stop.

  KEYS[1] queued      list   ids ready to run
  KEYS[2] scheduled   zset   id -> due time (ms)
  KEYS[3] job prefix  string job hashes are KEYS[3] .. id (same {queue} slot)

  ARGV[1] id            job id
  ARGV[2] tombstone_ms  how long a cancelled scheduled job's tombstone lives

  A running job (claimed: its holder may be running its task) is not
  dropped: its hash is marked instead, field 'cancel' = the token it was
  asked under ('attempt:gen'). Its holder learns it from its next lease
  renewal (extend.lua) or start mark (start.lua) and stops the task; every
  script that ends the attempt (ack, nack, release, recover) then finishes
  the job as 'cancelled' instead of acking, retrying or requeuing it. The
  mark never leaves the hash before that, so a job marked once never runs
  again whatever happens to its worker.

  A queued job is not searched for on its list (LREM over a long queue is
  O(n)): its hash becomes a tombstone, state 'cancelled', and claim.lua drops
  the id with its hash when it reaches it, so the job never starts. A
  scheduled job is taken off its sorted set at once (O(log n)) and its hash
  becomes the same tombstone for tombstone_ms, so that a late push of it
  (the same or an older generation, see enqueue.lua) is refused.

  Returns: { cancelled (1: taken off, or marked when running; 0 refused),
             state found ('' when no hash) }
]]
local queued_key = KEYS[1]
local scheduled_key = KEYS[2]
local job_prefix = KEYS[3]

--- @include "read_job"

--- @include "tombstone"

local job_id = ARGV[1]
local job_key = job_prefix .. job_id
local state = read_job(job_id, 'state')[1] or ''
if state == 'queued' then
  redis.call('HSET', job_key, 'state', 'cancelled')
  return { 1, state }
end
if state == 'scheduled' and redis.call('ZREM', scheduled_key, job_id) > 0 then
  local tombstone_ms = tonumber(ARGV[2])
  if tombstone_ms == nil or tombstone_ms ~= math.floor(tombstone_ms) or tombstone_ms < 1 then
    tombstone_ms = CANCELLED_TOMBSTONE_MS
  end
  local gen = redis.call('HGET', job_key, 'gen') or '0'
  leave_tombstone(job_id, 'cancelled', gen, tombstone_ms)
  return { 1, state }
end
if state == 'running' then
  local token = redis.call('HMGET', job_key, 'attempts', 'gen', 'cancel')
  if not token[3] then
    redis.call('HSET', job_key, 'cancel', (token[1] or '0') .. ':' .. (token[2] or '0'))
  end
  return { 1, state }
end
return { 0, state }
