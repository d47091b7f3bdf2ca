--[[
  include server_clock: now_ms(), the Redis server clock in whole milliseconds.

  Every deadline (lease, retry, schedule) is read from TIME inside the script
  that writes it, so workers' clocks never matter.
]]
local function now_ms()
  local clock = redis.call('TIME')
  return tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
end
