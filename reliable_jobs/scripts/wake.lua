--[[
  wake: on Redis Cluster, signal that a queue may have work (at most one marker).

  KEYS[1] wake  list   the queue's wake marker; on a cluster the broker passes
                       the one in the shared wake slot (keys.wake_marker)

  A worker that serves several queues on a cluster cannot block on lists in
  different slots with one command, so every queue's marker lives in one
  slot of its own, and the broker calls this after a script that made work
  ready. Off a cluster the scripts push their in-slot marker themselves.

  Returns: 1 if a marker was pushed, 0 if one was already waiting.
]]
local wake_key = KEYS[1]

--- @include "wake_marker"

return push_wake_marker(wake_key)
