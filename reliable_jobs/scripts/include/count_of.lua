--[[
  include count_of: count_of(value, lowest), a counter read from a job hash.

  attempts, gen and max_attempts are whole numbers from lowest to 2^31 - 1
  (the mirror's integer columns) whatever the hash holds: a damaged or
  missing value reads as lowest, never as nil or NaN.
]]
local MAX_COUNT = 2147483647
local function count_of(value, lowest)
  local n = tonumber(value)
  if n == nil or n ~= n then
    return lowest
  end
  return math.max(lowest, math.min(MAX_COUNT, math.floor(n)))
end
