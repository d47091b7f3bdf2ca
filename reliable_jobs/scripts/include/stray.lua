--[[
  include stray: consume_stray(job_id), for the copies reprioritize.lua leaves.

  A reprioritized job's old copy stays on its old list and is counted in
  strays_key (a zset id -> copies left behind). The including script names
  strays_key as a local before the include line. Takes one off the id's
  count; returns false when strays counts none (the copy is not a stray).
]]
local function consume_stray(job_id)
  local left = tonumber(redis.call('ZSCORE', strays_key, job_id))
  if left == nil then
    return false
  end
  if left <= 1 then
    redis.call('ZREM', strays_key, job_id)
  else
    redis.call('ZINCRBY', strays_key, -1, job_id)
  end
  return true
end
