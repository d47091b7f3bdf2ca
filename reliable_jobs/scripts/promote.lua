--[[
  promote: move due jobs from scheduled to queued.

  KEYS[1] queued      list   ids ready to run (producers push on the left)
  KEYS[2] scheduled   zset   id -> due time (ms, server clock)
  KEYS[3] wake        list   at most one marker, pushed when work arrives
  KEYS[4] job prefix  string job hashes are KEYS[4] .. id (same {queue} slot)

  ARGV[1] limit  jobs promoted per call at most

  An id whose hash is gone or not 'scheduled' (cancelled, or a stray) is
  dropped from scheduled; the database reconcile restores a real job that
  Redis lost. A damaged hash (no state, or a state no script writes) is
  deleted as well, so that reconcile rebuilds that job too. A promoted job's
  hash gets 'ready_ms' (now), from which latency.lua measures its wait.

  Returns: the number of jobs promoted.
]]
local queued_key = KEYS[1]
local scheduled_key = KEYS[2]
local wake_key = KEYS[3]
local job_prefix = KEYS[4]

local clock = redis.call('TIME')
local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)

local KNOWN_STATES = {
  queued = true, running = true, scheduled = true, dead = true, finished = true, cancelled = true
}

local due = redis.call('ZRANGEBYSCORE', scheduled_key, '-inf', now_ms, 'LIMIT', 0, tonumber(ARGV[1]))
local ready = {}
for _, job_id in ipairs(due) do
  redis.call('ZREM', scheduled_key, job_id)
  local job_key = job_prefix .. job_id
  local state = redis.call('HGET', job_key, 'state')
  if state == 'scheduled' then
    redis.call('HSET', job_key, 'state', 'queued', 'ready_ms', now_ms)
    ready[#ready + 1] = job_id
  elseif not KNOWN_STATES[state] then
    redis.call('DEL', job_key)
  end
end
for i = 1, #ready, 1000 do
  redis.call('LPUSH', queued_key, unpack(ready, i, math.min(i + 999, #ready)))
end
if #ready > 0 and redis.call('LLEN', wake_key) == 0 then
  redis.call('RPUSH', wake_key, '1')
end
return #ready
