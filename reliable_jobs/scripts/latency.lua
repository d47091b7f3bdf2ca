--[[
  latency: how long the oldest ready job and the oldest due scheduled job
  have waited, without acting.

  KEYS[1] queued      list   ids ready to run (the oldest on the right)
  KEYS[2] scheduled   zset   id -> due time (ms, server clock)
  KEYS[3] job prefix  string job hashes are KEYS[3] .. id (same {queue} slot)

  ARGV[1] look  ids read from the oldest end of queued at most (whole number
                from 1 to 1000): cancelled tombstones and stray copies are
                skipped, so the first 'queued' one within them is the oldest
                job that will run

  A job is ready since 'ready_ms' in its hash (written when promote,
  requeue or revive made it ready) or else since 'enqueued_ms' (enqueue);
  a job put back by a retry without delay, a lost lease or a graceful stop
  counts from there too. A scheduled job is due from its score on; one
  still on scheduled past it waits for promote (every worker runs it each
  SWEEP_INTERVAL_MS), so its age is how late promotion is. Read-only, and
  O(look) + O(log n): the page that calls it costs the same with a million
  jobs queued.

  Returns: { now_ms, queued, ready_id, ready_ms, due_id, due_ms }
    now_ms    the server's clock (ms), which the ages are measured on
    queued    length of queued
    ready_id  the oldest ready job's id, '' when none was found in the look
    ready_ms  when it became ready (ms), 0 when none (or its hash holds no time)
    due_id    the oldest scheduled job that is due, '' when none
    due_ms    its due time (ms), 0 when none
  Errors: look not a whole number from 1 to 1000.
]]
local queued_key = KEYS[1]
local scheduled_key = KEYS[2]
local job_prefix = KEYS[3]

local look = tonumber(ARGV[1])
if look == nil or look ~= math.floor(look) or look < 1 or look > 1000 then
  return redis.error_reply('ERR latency: look must be a whole number from 1 to 1000')
end

--- @include "server_clock"

local now = now_ms()
local queued = redis.call('LLEN', queued_key)
local ready_id, ready_ms = '', 0
local oldest = redis.call('LRANGE', queued_key, -look, -1)
for i = #oldest, 1, -1 do
  local job_id = oldest[i]
  local job_key = job_prefix .. job_id
  local job = redis.call('HMGET', job_key, 'state', 'ready_ms', 'enqueued_ms')
  if job[1] == 'queued' then
    ready_id = job_id
    ready_ms = tonumber(job[2]) or tonumber(job[3]) or 0
    break
  end
end

local due_id, due_ms = '', 0
local due = redis.call('ZRANGEBYSCORE', scheduled_key, '-inf', now, 'WITHSCORES', 'LIMIT', 0, 1)
if #due > 0 then
  due_id = due[1]
  due_ms = tonumber(due[2]) or 0
end
return { now, queued, ready_id, ready_ms, due_id, due_ms }
