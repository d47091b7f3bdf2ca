--[[
  include band_of: band_of(value), a job's priority as its hash holds it.

  A whole number from -100 to 100 (Django's range), 0 when the field is
  absent (enqueue.lua writes it only when it is not 0) or damaged, so a
  bad value never names a band list outside the range.
]]
local function band_of(value)
  local n = tonumber(value)
  if n == nil or n ~= n then
    return 0
  end
  return math.max(-100, math.min(100, math.floor(n)))
end
