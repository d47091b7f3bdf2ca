--[[
  include fence: holds(job, attempt, gen), the fencing test of every outcome.

  job is HMGET <job hash> state attempts gen; attempt and gen are the token
  the caller got from claim, as strings. Only the current holder passes: the
  job is 'running' with exactly that attempt number and generation (a hash
  written before generations existed reads as gen '0').
]]
local function holds(job, attempt, gen)
  return job[1] == 'running' and job[2] == attempt and (job[3] or '0') == gen
end
