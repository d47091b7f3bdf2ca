--[[
  pause: pause or resume one shard of a queue (the claim and start read the flag).

  KEYS[1] paused      string the flag: while it exists claim.lua takes nothing
                             and start.lua lets no claimed job start; its
                             value is when (ms, server clock) it was set
  KEYS[2] wake        list   at most one marker, pushed on resume when work waits
  KEYS[3] queued      list   ids ready to run at priority 0
  KEYS[4] bands       zset   non-zero priorities with a non-empty band list
  KEYS[5] fair_bands  zset   priorities with fair groups waiting (see claim.lua)
  KEYS[6] holds       zset   limits holding jobs back (see claim.lua)

  ARGV[1] paused    1 to pause, 0 to resume
  ARGV[2] since_ms  when the pause began (ms since the epoch, from the
                    mirror's row), or 0 for this server's clock now: a flag
                    put back after Redis lost it keeps its first time

  A pause that finds the flag set keeps its value (the first pause's time),
  so pausing twice says "paused since" the first. A resume that finds work
  waiting pushes the wake marker: workers that slept on this paused queue's
  marker start claiming again at once, not at their next timed wait.

  Returns: 1 if the flag changed (set where absent, or removed), else 0.
  Errors: ARGV[1] not 0 or 1 (nothing is written).
]]
local paused_key = KEYS[1]
local wake_key = KEYS[2]
local queued_key = KEYS[3]
local bands_key = KEYS[4]
local fair_bands_key = KEYS[5]
local holds_key = KEYS[6]

--- @include "wake_marker"

--- @include "server_clock"

if ARGV[1] ~= '0' and ARGV[1] ~= '1' then
  return redis.error_reply('ERR pause: ARGV[1] must be 0 or 1')
end

if ARGV[1] == '1' then
  local since = tonumber(ARGV[2]) or 0
  if since <= 0 then
    since = now_ms()
  end
  return redis.call('SET', paused_key, since, 'NX') and 1 or 0
end

local removed = redis.call('DEL', paused_key)
if removed == 1 and (redis.call('LLEN', queued_key) > 0 or redis.call('ZCARD', bands_key) > 0
    or redis.call('ZCARD', fair_bands_key) > 0 or redis.call('ZCARD', holds_key) > 0) then
  push_wake_marker(wake_key)
end
return removed
