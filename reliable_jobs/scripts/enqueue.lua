--[[
  enqueue: write job hashes and make each job runnable, in one step.

  KEYS[1] queued      list   ids ready to run at priority 0 (producers push
                             on the left)
  KEYS[2] scheduled   zset   id -> due time (ms)
  KEYS[3] wake        list   at most one marker, pushed when work arrives
  KEYS[4] job prefix  string job hashes are KEYS[4] .. id (same {queue} slot)
  KEYS[5] bands       zset   the non-zero priorities whose band list is not
                             empty (member and score: the priority)
  KEYS[6] band prefix string the list of priority p is KEYS[6] .. p (p a
                             non-zero whole number from -100 to 100)
  KEYS[7] fair_bands  zset   priorities with fair groups waiting (see claim.lua)
  KEYS[8] rota prefix string the rotation of priority p is KEYS[8] .. p
  KEYS[9] group prefix string group g's list at priority p: KEYS[9] .. p .. ':' .. g

  ARGV, repeated in groups of eight, one group per job:
    id            job id
    payload       JSON text
    max_attempts  integer >= 1
    due_ms        run_after in ms since the epoch, 0 for "now"
    attempts      attempts already spent (0 for a new job; the mirror's count
                  when the sweep rebuilds a job that Redis lost)
    gen           the job's generation: 0 when first enqueued, and one more
                  at every rebuild from the mirror (part of the fencing
                  token, so a holder from before a rebuild is refused)
    priority      -100 to 100
    group         the job's fair group, '' for none: the job waits on its
                  group's list and takes turns with the other groups (see
                  band_push.lua and claim.lua)

  A job whose hash already exists is never queued twice, so the on-commit
  push and a reconcile push of the same job can never run it twice. A
  finished job of a generation > 0 leaves a tombstone (state 'finished',
  see ack.lua), and so does a job cancelled while queued ('cancelled', see
  cancel.lua): a push of the same or an older generation (a late on-commit
  push) is refused by it, a push of a newer generation (a rebuild) replaces
  it. A rebuild's row holds its new generation before the push is sent
  (sweep.push_rebuilt), so a push of a newer generation that finds an older
  incarnation still waiting (queued or scheduled: a late push that landed
  after reconcile looked) takes it over where it waits: its gen, attempts
  and max_attempts become the push's (never fewer than it had), and no
  second copy of the id is queued. Any other hash (a claimed or dead job,
  or one of the same or a newer generation) is left alone.

  Returns: a list with 1 (written, or taken over) or 0 (left alone) per job.
  Errors: ARGV not in groups of eight, a gen that is not a whole number
  from 0 to 2^31 - 1, or a priority that is not a whole number from -100 to
  100 (nothing is written).
]]
local queued_key = KEYS[1]
local scheduled_key = KEYS[2]
local wake_key = KEYS[3]
local job_prefix = KEYS[4]
local bands_key = KEYS[5]
local band_prefix = KEYS[6]
local fair_bands_key = KEYS[7]
local rota_prefix = KEYS[8]
local group_prefix = KEYS[9]

--- @include "wake_marker"

if #ARGV % 8 ~= 0 then
  return redis.error_reply('ERR enqueue: ARGV must come in groups of eight '
    .. '(id, payload, max_attempts, due_ms, attempts, gen, priority, group)')
end

-- Every gen must be a whole number within the mirror's integer range, and
-- every priority one within Django's, before anything is written.
for i = 6, #ARGV, 8 do
  local gen = tonumber(ARGV[i])
  if gen == nil or gen ~= math.floor(gen) or gen < 0 or gen > 2147483647 then
    return redis.error_reply('ERR enqueue: gen must be a whole number from 0 to 2^31 - 1, not '
      .. string.sub(tostring(ARGV[i]), 1, 40))
  end
  local priority = tonumber(ARGV[i + 1])
  if priority == nil or priority ~= math.floor(priority) or priority < -100 or priority > 100 then
    return redis.error_reply('ERR enqueue: priority must be a whole number from -100 to 100, not '
      .. string.sub(tostring(ARGV[i + 1]), 1, 40))
  end
end

--- @include "server_clock"

--- @include "read_job"

--- @include "band_push"

local now = now_ms()

local written = {}
local ready = {}
local banded = 0
for i = 1, #ARGV, 8 do
  local job_id = ARGV[i]
  local job_key = job_prefix .. job_id
  local found, wrong_type = read_job(job_id, 'state', 'gen', 'attempts', 'max_attempts')
  local free = found[1] == false
  local newer = (tonumber(ARGV[i + 5]) or 0) > (tonumber(found[2]) or 0)
  local taken_over = false
  if wrong_type then
    -- A key of another type under the job's name (written by hand): the
    -- job is the one to keep.
    redis.call('DEL', job_key)
    free = true
  elseif (found[1] == 'finished' or found[1] == 'cancelled') and newer then
    redis.call('DEL', job_key)
    free = true
  elseif (found[1] == 'queued' or found[1] == 'scheduled') and newer then
    redis.call('HSET', job_key, 'gen', ARGV[i + 5],
      'attempts', math.max(tonumber(found[3]) or 0, tonumber(ARGV[i + 4]) or 0),
      'max_attempts', math.max(tonumber(found[4]) or 0, tonumber(ARGV[i + 2]) or 0))
    taken_over = true
  end
  if taken_over then
    written[#written + 1] = 1
  elseif free then
    local due_ms = tonumber(ARGV[i + 3]) or 0
    local priority = tonumber(ARGV[i + 6])
    local group = ARGV[i + 7]
    local state = 'queued'
    if due_ms > now then
      state = 'scheduled'
      redis.call('ZADD', scheduled_key, due_ms, job_id)
    elseif priority == 0 and group == '' then
      ready[#ready + 1] = job_id
    else
      push_band_behind(job_id, priority, group)
      banded = banded + 1
    end
    redis.call('HSET', job_key, 'state', state, 'payload', ARGV[i + 1],
      'max_attempts', ARGV[i + 2], 'attempts', ARGV[i + 4], 'gen', ARGV[i + 5],
      'enqueued_ms', now)
    if priority ~= 0 then
      redis.call('HSET', job_key, 'priority', priority)
    end
    if group ~= '' then
      redis.call('HSET', job_key, 'fair', group)
    end
    written[#written + 1] = 1
  else
    written[#written + 1] = 0
  end
end

-- unpack() has a stack limit: push in chunks.
for i = 1, #ready, 1000 do
  redis.call('LPUSH', queued_key, unpack(ready, i, math.min(i + 999, #ready)))
end
if #ready > 0 then
  plain_joined(0)
end
if #ready + banded > 0 then
  push_wake_marker(wake_key)
end
return written
