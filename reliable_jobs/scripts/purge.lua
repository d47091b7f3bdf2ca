--[[
  purge: forget dead jobs whose history is being pruned from the database.

  KEYS[1] dead        zset   id -> time of death (ms)
  KEYS[2] job prefix  string job hashes are KEYS[2] .. id (same {queue} slot)

  ARGV[1..n] ids  job ids

  Dead jobs keep their hash so staff can revive them; once their rows are
  pruned nothing can, so the hash and the dead-set entry go too. A job that
  is not dead in Redis (revived meanwhile) is left alone.

  Returns: the number of job hashes deleted.
]]
local dead_key = KEYS[1]
local job_prefix = KEYS[2]

--- @include "read_job"

local purged = 0
for i = 1, #ARGV do
  local job_id = ARGV[i]
  local job_key = job_prefix .. job_id
  local state = read_job(job_id, 'state')[1]
  if state == 'dead' then
    redis.call('DEL', job_key)
    purged = purged + 1
  end
  if state == 'dead' or not state then
    redis.call('ZREM', dead_key, job_id)
  end
end
return purged
