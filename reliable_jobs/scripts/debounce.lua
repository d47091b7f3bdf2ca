--[[
  debounce: make a debounced job, or push a pending one back with the last
  call's payload, in one step, on the server's clock.

  KEYS[1] scheduled   zset   id -> due time (ms)
  KEYS[2] job prefix  string job hashes are KEYS[2] .. id (same {queue} slot)

  ARGV[1] id            job id
  ARGV[2] payload       JSON text of the call (it replaces a pending job's)
  ARGV[3] max_attempts  integer >= 1 (a job made here)
  ARGV[4] attempts      attempts already spent (a job made here: the row's)
  ARGV[5] gen           the job's generation (a job made here: the row's)
  ARGV[6] priority      -100 to 100 (a job made here)
  ARGV[7] group         fair group, '' for none (a job made here)
  ARGV[8] debounce_ms   integer >= 1: the job is due this long after the call
  ARGV[9] max_wait_ms   integer >= 0: a pending job is never due later than
                        this long after it was made (0: no such bound)
  ARGV[10] mode         'make': only make the job (the on-commit push of a
                        new row; a job already there is left alone);
                        'replace': make it, or replace a pending one

  A job is *pending* while it waits in scheduled and was never claimed
  (state 'scheduled', attempts 0, the caller's generation): only a pending
  job takes a later call's payload, and its due time becomes
  min(now + debounce_ms, made + max_wait_ms), made being its hash's
  'enqueued_ms' (a due time in the past leaves it for the next promote).
  Once promote moved it to queued, or a worker claimed it, it keeps its
  payload and the call is refused: the caller makes another job, so a call
  never changes a run that may have begun, and a run is never lost. A job
  with no hash (its own on-commit push not arrived yet, or lost by Redis)
  is made here with the caller's values, scheduled debounce_ms from now; a
  late push of it then finds the hash and is refused (enqueue.lua, or this
  script's 'make'). Any other hash (a tombstone, a dead job, another
  generation, a damaged key) is left alone.

  Returns: { outcome, due_ms }: outcome 1 made, 2 replaced, 0 refused (due_ms
  0, and the state found as a third element, '' when no hash).
  Errors: a numeric ARGV out of range, or an unknown mode (nothing written).
]]
local scheduled_key = KEYS[1]
local job_prefix = KEYS[2]

local job_id = ARGV[1]
local payload = ARGV[2]
local gen = tonumber(ARGV[5])
local priority = tonumber(ARGV[6])
local group = ARGV[7]
local debounce_ms = tonumber(ARGV[8])
local max_wait_ms = tonumber(ARGV[9])
local mode = ARGV[10]

local function whole(value, low, high)
  return value ~= nil and value == math.floor(value) and value >= low and value <= high
end

if not (whole(gen, 0, 2147483647) and whole(priority, -100, 100)
        and whole(debounce_ms, 1, 2^48) and whole(max_wait_ms, 0, 2^48)) then
  return redis.error_reply('ERR debounce: gen, priority, debounce_ms or max_wait_ms out of range')
end
if mode ~= 'make' and mode ~= 'replace' then
  return redis.error_reply('ERR debounce: mode must be make or replace, not '
    .. string.sub(tostring(mode), 1, 40))
end

--- @include "server_clock"

--- @include "read_job"

local now = now_ms()
local job_key = job_prefix .. job_id
local found, wrong_type = read_job(job_id, 'state', 'attempts', 'gen', 'enqueued_ms')

if found[1] == false and not wrong_type then
  local due = now + debounce_ms
  redis.call('ZADD', scheduled_key, due, job_id)
  redis.call('HSET', job_key, 'state', 'scheduled', 'payload', payload,
    'max_attempts', ARGV[3], 'attempts', ARGV[4], 'gen', ARGV[5], 'enqueued_ms', now)
  if priority ~= 0 then
    redis.call('HSET', job_key, 'priority', priority)
  end
  if group ~= '' then
    redis.call('HSET', job_key, 'fair', group)
  end
  return { 1, due }
end

local pending = mode == 'replace' and found[1] == 'scheduled'
  and tonumber(found[2]) == 0 and tonumber(found[3]) == gen
  and redis.call('ZSCORE', scheduled_key, job_id)
if not pending then
  return { 0, 0, found[1] or '' }
end

local due = now + debounce_ms
local made = tonumber(found[4]) or now
if max_wait_ms > 0 and made + max_wait_ms < due then
  due = made + max_wait_ms
end
redis.call('ZADD', scheduled_key, due, job_id)
redis.call('HSET', job_key, 'payload', payload)
return { 2, due }
