--[[
  latency: how long the oldest ready job and the oldest due scheduled job
  have waited, without acting.

  KEYS[1] queued      list   ids ready to run (the oldest on the right)
  KEYS[2] scheduled   zset   id -> due time (ms, server clock)
  KEYS[3] job prefix  string job hashes are KEYS[3] .. id (same {queue} slot)
  KEYS[4] bands       zset   non-zero priorities with a non-empty band list
  KEYS[5] band prefix string the list of priority p is KEYS[5] .. p

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
  jobs queued. Jobs of other priorities than 0 wait on their own lists
  (see claim.lua): each list in use is looked at the same way, and the
  oldest ready job of all is reported, O(look) per priority in use.

  Returns: { now_ms, queued, ready_id, ready_ms, due_id, due_ms }
    now_ms    the server's clock (ms), which the ages are measured on
    queued    length of queued and of every priority's list
    ready_id  the oldest ready job's id, '' when none was found in the look
    ready_ms  when it became ready (ms), 0 when none (or its hash holds no time)
    due_id    the oldest scheduled job that is due, '' when none
    due_ms    its due time (ms), 0 when none
  Errors: look not a whole number from 1 to 1000.
]]
local queued_key = KEYS[1]
local scheduled_key = KEYS[2]
local job_prefix = KEYS[3]
local bands_key = KEYS[4]
local band_prefix = KEYS[5]

local look = tonumber(ARGV[1])
if look == nil or look ~= math.floor(look) or look < 1 or look > 1000 then
  return redis.error_reply('ERR latency: look must be a whole number from 1 to 1000')
end

--- @include "server_clock"

--- @include "read_job"

local now = now_ms()
local queued = redis.call('LLEN', queued_key)
local ready_id, ready_ms = '', 0

-- The oldest job that will run among a list's oldest ids; keep the oldest seen.
local function look_at(oldest)
  for i = #oldest, 1, -1 do
    local job_id = oldest[i]
    local job = read_job(job_id, 'state', 'ready_ms', 'enqueued_ms')
    if job[1] == 'queued' then
      local since = tonumber(job[2]) or tonumber(job[3]) or 0
      if ready_id == '' or since < ready_ms then
        ready_id, ready_ms = job_id, since
      end
      return
    end
  end
end

look_at(redis.call('LRANGE', queued_key, -look, -1))
for _, band in ipairs(redis.call('ZRANGE', bands_key, 0, -1)) do
  queued = queued + redis.call('LLEN', band_prefix .. band)
  look_at(redis.call('LRANGE', band_prefix .. band, -look, -1))
end

local due_id, due_ms = '', 0
local due = redis.call('ZRANGEBYSCORE', scheduled_key, '-inf', now, 'WITHSCORES', 'LIMIT', 0, 1)
if #due > 0 then
  due_id = due[1]
  due_ms = tonumber(due[2]) or 0
end
return { now, queued, ready_id, ready_ms, due_id, due_ms }
