--[[
  expired: list started attempts whose lease has expired, without acting.

  KEYS[1] leases      zset   id -> lease deadline (ms, server clock)
  KEYS[2] job prefix  string job hashes are KEYS[2] .. id (same {queue} slot)

  ARGV[1] limit  expired leases inspected at most

  The sweep asks this before recover: an attempt that started may have
  written its outcome to the database mirror and died before its ack. The
  sweep looks those up in the mirror and passes the ones it finds to
  recover.lua to settle, so a job whose success is already recorded is
  neither run again nor buried. Read-only.

  Returns: flat list: id, attempt, gen per expired lease of a 'running' job
  whose attempt started.
  Errors: limit not a whole number from 0 to 2^52.
]]
local leases_key = KEYS[1]
local job_prefix = KEYS[2]

local limit = tonumber(ARGV[1])
if limit == nil or limit ~= math.floor(limit) or limit < 0 or limit > 4503599627370496 then
  return redis.error_reply('ERR expired: limit must be a whole number from 0 to 2^52')
end

--- @include "count_of"
--- @include "server_clock"

--- @include "read_job"

local found = {}
for _, job_id in ipairs(redis.call('ZRANGEBYSCORE', leases_key, '-inf', now_ms(), 'LIMIT', 0, limit)) do
  local job = read_job(job_id, 'state', 'attempts', 'started', 'gen')
  if job[1] == 'running' and job[2] and job[3] == job[2] then
    found[#found + 1] = job_id
    found[#found + 1] = job[2]
    found[#found + 1] = count_of(job[4], 0)
  end
end
return found
