--[[
  include wake_marker: push_wake_marker(wake_key), at most one marker waiting.

  An idle worker that serves several queues blocks on their wake lists; one
  marker is enough to wake one worker, which pushes another if it leaves work
  behind, so the list never grows past one entry.

  Returns: 1 if a marker was pushed, 0 if one was already waiting.
]]
local function push_wake_marker(wake_key)
  if redis.call('LLEN', wake_key) == 0 then
    redis.call('RPUSH', wake_key, '1')
    return 1
  end
  return 0
end
