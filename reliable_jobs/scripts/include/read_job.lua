--[[
  include read_job: read_job(job_id, field, ...), HMGET of a job hash that
  never fails.

  A key of another type under a job's name (written by hand) makes HMGET
  fail with WRONGTYPE, and an error ends a script half-way: after the writes
  made for the ids before it (a claimed id then on no list), and again at
  every later call, so one such key stopped every claim or sweep pass of its
  queue. read_job reads it as a damaged hash instead: an empty table (every
  field nil, so neither a missing hash, whose state is false, nor any known
  state), and true as a second value. Each script then treats the id as it
  treats a damaged hash (claim, promote and recover move it aside as
  garbage; the fenced scripts refuse it; enqueue replaces the key). The
  including script names job_prefix as a local before the include line.
]]
local function read_job(job_id, ...)
  local job = redis.pcall('HMGET', job_prefix .. job_id, ...)
  if job.err then
    return {}, true
  end
  return job, false
end
