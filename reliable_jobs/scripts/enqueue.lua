--[[
  enqueue: write job hashes and make each job runnable, in one step.

  KEYS[1] queued     list   ids ready to run (producers push on the left)
  KEYS[2] scheduled  zset   id -> due time (ms)
  KEYS[3] wake       list   at most one marker, pushed when work arrives
  KEYS[4] job prefix string job hashes are KEYS[4] .. id (same {queue} slot)

  ARGV, repeated in groups of five, one group per job:
    id            job id
    payload       JSON text
    max_attempts  integer >= 1
    due_ms        run_after in ms since the epoch, 0 for "now"
    attempts      attempts already spent (0 for a new job; the mirror's count
                  when the sweep rebuilds a job that Redis lost)

  A job whose hash already exists is left alone, so the on-commit push and a
  reconcile push of the same job can never queue it twice.

  Returns: the number of jobs written.
  Errors: ARGV not in groups of five (nothing is written).
]]
local queued_key = KEYS[1]
local scheduled_key = KEYS[2]
local wake_key = KEYS[3]
local job_prefix = KEYS[4]

if #ARGV % 5 ~= 0 then
  return redis.error_reply(
    'ERR enqueue: ARGV must come in groups of five (id, payload, max_attempts, due_ms, attempts)')
end

local clock = redis.call('TIME')
local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)

local written = 0
local ready = {}
for i = 1, #ARGV, 5 do
  local job_id = ARGV[i]
  local job_key = job_prefix .. job_id
  if redis.call('EXISTS', job_key) == 0 then
    local due_ms = tonumber(ARGV[i + 3]) or 0
    local state = 'queued'
    if due_ms > now_ms then
      state = 'scheduled'
      redis.call('ZADD', scheduled_key, due_ms, job_id)
    else
      ready[#ready + 1] = job_id
    end
    redis.call('HSET', job_key, 'state', state, 'payload', ARGV[i + 1],
      'max_attempts', ARGV[i + 2], 'attempts', ARGV[i + 4], 'enqueued_ms', now_ms)
    written = written + 1
  end
end

-- unpack() has a stack limit: push in chunks.
for i = 1, #ready, 1000 do
  redis.call('LPUSH', queued_key, unpack(ready, i, math.min(i + 999, #ready)))
end
if #ready > 0 and redis.call('LLEN', wake_key) == 0 then
  redis.call('RPUSH', wake_key, '1')
end
return written
