--[[
  recover: put jobs whose lease expired back on queued (or bury them).

  KEYS[1] queued      list   ids ready to run (the oldest on the right)
  KEYS[2] processing  list   legacy: where 0.1 kept claimed ids (drained here)
  KEYS[3] leases      zset   id -> lease deadline (ms, server clock): the
                             in-flight index
  KEYS[4] dead        zset   id -> time of death (ms)
  KEYS[5] wake        list   at most one marker, pushed when work arrives
  KEYS[6] job prefix  string job hashes are KEYS[6] .. id (same {queue} slot)
  KEYS[7] landing     list   ids moved off queued by BLMOVE, not yet stamped
  KEYS[8] bands       zset   non-zero priorities with a non-empty band list
  KEYS[9] band prefix string the list of priority p is KEYS[9] .. p
  KEYS[10] strays     zset   id -> copies reprioritize.lua left on a band
  KEYS[11] fair_bands  zset   priorities with fair groups waiting (see claim.lua)
  KEYS[12] rota prefix string the rotation of priority p is KEYS[12] .. p
  KEYS[13] group prefix string group g's list at priority p: KEYS[13] .. p .. ':' .. g

  ARGV[1] limit         expired leases handled per call at most
  ARGV[2] lease_ms      lease given to an id found on landing without one
  ARGV[3] tombstone_ms  how long a settled rebuilt job's tombstone lives
  ARGV[4] settle_count  how many settle groups follow
  ARGV[5] started       'all': act on every expired started attempt;
                        'listed': only on those listed after the groups
  ARGV[6] expired_class the class path that opens the error of a job buried
                        because its lease expired with no attempt left (the
                        broker passes exceptions.class_path(LeaseExpired), so
                        the path always names a class that exists)
  ARGV[7..]             settle_count groups of five, the attempts to settle:
                        id, attempt, gen, final ('succeeded', 'dead',
                        'cancelled' or 'snoozed'), error; then triples id, attempt, gen: the started
                        attempts the caller lets this call requeue or bury

  An attempt that started may have written its outcome to the database
  mirror before its worker died. The sweep asks expired.lua for the started
  attempts whose lease expired, locks their rows, and passes the ones the
  mirror holds as finished to settle, and the others as allowed to requeue
  or bury; it mirrors what happened before it lets the rows go, so a late
  outcome of the same attempt finds it recorded as expired. A started
  attempt the caller did not list (its lease expired after expired.lua
  looked, or its row was busy) is left for the next pass.

  Settling comes first: the attempt is finished as the mirror says, removed
  like an ack ('succeeded'; a tombstone when gen > 0, see ack.lua), buried
  with that error ('dead'), left as a 'cancelled' tombstone
  ('cancelled'), or queued again with its attempt given back as snooze.lua
  would have ('snoozed': its task raised Snooze, its worker died before the
  snooze reached Redis; it runs again now rather than after the delay, which
  the mirror's clock cannot decide). Fenced: only if the job is still
  'running' with that attempt and gen and its lease has expired.

  Then every other expired lease. An expired 'running' job whose attempt
  never started (no start mark for it, see start.lua) goes back on the right
  of queued with one more attempt in its budget (max_attempts + 1): its
  worker died before running it, so it is not charged. One whose attempt
  started and whose attempts are spent goes to dead (G3); otherwise it goes
  back on the right of queued, to run next. A 'running' job marked for
  cancellation (field 'cancel', see cancel.lua), started or not, is never
  run again: it becomes a 'cancelled' tombstone.

  An id on landing with no lease (its worker died between BLMOVE and the
  claim script) is stamped with a lease the first time it is seen, and comes
  back when that expires without being charged an attempt: its state is
  still 'queued' because no claim ever ran. An id on landing whose job has
  already ended (finished, dead or cancelled: a stale copy, the job was run
  from another push) leaves landing at once, unleased, so it never counts
  again in a concurrency cap's running set. Landing holds only ids between
  a BLMOVE and the claim that follows it, so this costs the same however
  many jobs are in flight. An id on the legacy processing list (where
  version 0.1 kept claimed ids; left there by an upgrade, or written there
  by hand) is moved into leases, 100 ids per call, with a first lease when
  it has none, and is recovered like any other when that expires.

  An id with no job hash is garbage and goes to dead; so does one whose hash
  is damaged (no state, or a state no script writes), and that hash is
  deleted so that reconcile rebuilds the job from the database. attempts
  and max_attempts are read as whole numbers from 0 (1) to 2^31 - 1 (the
  mirror's integer columns), whatever the hash holds.

  Every job put back keeps its priority: "queued" above means the right of
  the list of its band (queued itself for priority 0), to run next among the
  jobs of that priority. An id without a hash that strays counts (a copy
  left behind by reprioritize.lua whose job has since finished) is dropped
  ('dropped'), not buried as garbage.

  Safe to run concurrently with itself, workers and other sweeps: each step
  is one atomic script, and an id is acted on only while its expired lease
  is in leases (an ack or a newer claim takes it out or moves it on).

  Returns: { outcomes, stamped }
    outcomes  flat list: id, attempts, max_attempts, kind, gen per handled
              lease, where kind is 'settled' (finished as the mirror says),
              'cancelled' (marked for cancellation: not run again),
              'expired' (requeued), 'unstarted' (requeued, refunded),
              'dead', 'orphan' (requeued, never claimed), 'garbage' (no job
              hash, or a damaged one) or 'dropped' (stray copy of a job
              that lives elsewhere)
    stamped   how many orphans got a first lease
  Errors: limit, lease_ms, tombstone_ms or settle_count not a whole number
  from 0 to 2^52, expired_class not a dotted path, or the settle groups not
  in fives (nothing is written).
]]
local queued_key = KEYS[1]
local processing_key = KEYS[2]
local leases_key = KEYS[3]
local dead_key = KEYS[4]
local wake_key = KEYS[5]
local job_prefix = KEYS[6]
local landing_key = KEYS[7]
local bands_key = KEYS[8]
local band_prefix = KEYS[9]
local strays_key = KEYS[10]
local fair_bands_key = KEYS[11]
local rota_prefix = KEYS[12]
local group_prefix = KEYS[13]

--- @include "wake_marker"
--- @include "fence"

--- @include "band_of"

--- @include "stray"

--- @include "band_push"

-- Ids moved off the legacy processing list per call.
local LEGACY_SLICE = 100

-- A whole number from ARGV, or an error reply before anything is written.
local function whole(value, name)
  local n = tonumber(value)
  if n == nil or n ~= math.floor(n) or n < 0 or n > 4503599627370496 then
    error({ err = 'ERR recover: ' .. name .. ' must be a whole number from 0 to 2^52, not '
      .. string.sub(tostring(value), 1, 40) })
  end
  return n
end

--- @include "count_of"

--- @include "read_job"

--- @include "tombstone"

local KNOWN_STATES = {
  queued = true, running = true, scheduled = true, dead = true, finished = true, cancelled = true
}

local limit = whole(ARGV[1], 'limit')
local lease_ms = whole(ARGV[2], 'lease_ms')
local tombstone_ms = math.max(1, whole(ARGV[3], 'tombstone_ms'))
local settle_count = whole(ARGV[4], 'settle_count')
local started_mode = ARGV[5]
local expired_class = ARGV[6]
if type(expired_class) ~= 'string' or not string.match(expired_class, '^[%a_][%w_.]*$') then
  error({ err = 'ERR recover: expired_class must be a dotted class path' })
end
local listed_from = 7 + 5 * settle_count
if (started_mode ~= 'all' and started_mode ~= 'listed') or #ARGV < listed_from - 1
    or (#ARGV - listed_from + 1) % 3 ~= 0 then
  error({ err = 'ERR recover: expected settle_count groups of five (id, attempt, gen, final, '
    .. 'error), then triples (id, attempt, gen), after started = all or listed and the '
    .. 'expired class' })
end

--- @include "server_clock"

local now = now_ms()

-- The started attempts this call may requeue or bury: id -> 'attempt:gen'.
local allowed = {}
for i = listed_from, #ARGV, 3 do
  allowed[ARGV[i]] = ARGV[i + 1] .. ':' .. ARGV[i + 2]
end

local outcomes = {}
local requeued = 0

local function report(job_id, attempts, max_attempts, kind, gen)
  outcomes[#outcomes + 1] = job_id
  outcomes[#outcomes + 1] = attempts
  outcomes[#outcomes + 1] = max_attempts
  outcomes[#outcomes + 1] = kind
  outcomes[#outcomes + 1] = gen
end

for i = 7, listed_from - 1, 5 do
  local job_id, final = ARGV[i], ARGV[i + 3]
  local job_key = job_prefix .. job_id
  local job = read_job(job_id, 'state', 'attempts', 'gen', 'max_attempts', 'priority', 'fair')
  local gen = job[3] or '0'
  local deadline = tonumber(redis.call('ZSCORE', leases_key, job_id))
  local budget = count_of(job[4], 1)
  if holds(job, ARGV[i + 1], ARGV[i + 2])
      and deadline and deadline <= now
      and (final == 'succeeded' or final == 'dead' or final == 'cancelled'
           or final == 'snoozed') then
    redis.call('ZREM', leases_key, job_id)
    if final == 'snoozed' then
      budget = math.min(budget + 1, MAX_COUNT)
      redis.call('HSET', job_key, 'state', 'queued', 'max_attempts', budget, 'ready_ms', now)
      push_band_next(job_id, band_of(job[5]), group_of(job[6]))
      requeued = requeued + 1
    elseif final == 'cancelled' then
      leave_tombstone(job_id, 'cancelled', gen, tombstone_ms)
    elseif final == 'dead' then
      redis.call('ZADD', dead_key, now, job_id)
      redis.call('HSET', job_key, 'state', 'dead', 'finished_ms', now,
        'last_error', ARGV[i + 4])
    elseif gen == '0' then
      redis.call('DEL', job_key)
    else
      leave_tombstone(job_id, 'finished', gen, tombstone_ms)
    end
    report(job_id, count_of(job[2], 0), budget, 'settled', gen)
  end
end
-- A started attempt the caller did not clear with the mirror stays leased.
local function held_back(job_id)
  if started_mode == 'all' then
    return false
  end
  local job = read_job(job_id, 'state', 'attempts', 'started', 'gen')
  if job[1] ~= 'running' or not job[2] or job[3] ~= job[2] then
    return false
  end
  return allowed[job_id] ~= job[2] .. ':' .. (job[4] or '0')
end

-- The states of a job that will not run again unless staff act on it.
local ENDED_STATES = { finished = true, dead = true, cancelled = true }

local expired = redis.call('ZRANGEBYSCORE', leases_key, '-inf', now, 'LIMIT', 0, limit)
for _, job_id in ipairs(expired) do
  if not held_back(job_id) then
    redis.call('ZREM', leases_key, job_id)
    -- An orphan leased on landing leaves it (landing holds a few ids at most).
    redis.call('LREM', landing_key, 1, job_id)
    local job_key = job_prefix .. job_id
    -- A key of another type under a job's name reads as a damaged hash: garbage.
    local job = read_job(job_id, 'state', 'attempts', 'max_attempts', 'started', 'gen',
      'cancel', 'priority', 'fair')
    local attempts = count_of(job[2], 0)
    local max_attempts = count_of(job[3], 1)
    local kind
    if job[1] == false and consume_stray(job_id) then
      kind = 'dropped'
    elseif not KNOWN_STATES[job[1]] then
      kind = 'garbage'
      redis.call('DEL', job_key)
      redis.call('ZADD', dead_key, now, job_id)
    elseif job[1] == 'running' and job[6] then
      kind = 'cancelled'
      leave_tombstone(job_id, 'cancelled', job[5] or '0', tombstone_ms)
    elseif job[1] == 'running' and job[4] ~= job[2] then
      kind = 'unstarted'
      max_attempts = math.min(max_attempts + 1, MAX_COUNT)
      redis.call('HSET', job_key, 'state', 'queued', 'max_attempts', max_attempts)
      push_band_next(job_id, band_of(job[7]), group_of(job[8]))
      requeued = requeued + 1
    elseif job[1] == 'running' and attempts >= max_attempts then
      kind = 'dead'
      redis.call('ZADD', dead_key, now, job_id)
      redis.call('HSET', job_key, 'state', 'dead', 'finished_ms', now, 'last_error',
        expired_class .. ': the lease of attempt ' .. attempts
        .. ' of ' .. max_attempts .. ' expired (worker lost or stalled) and no attempt is left')
    elseif job[1] == 'running' or job[1] == 'queued' then
      if job[1] == 'running' then kind = 'expired' else kind = 'orphan' end
      redis.call('HSET', job_key, 'state', 'queued')
      push_band_next(job_id, band_of(job[7]), group_of(job[8]))
      requeued = requeued + 1
    else
      kind = 'dropped'
      if job[1] == 'cancelled' and redis.call('PTTL', job_key) == -1 then
        -- Cancelled while queued (its id was on landing): no copy of it is
        -- left to drop it later, so its hash becomes the tombstone a claim
        -- would have left.
        leave_tombstone(job_id, 'cancelled', job[5] or '0', tombstone_ms)
      end
    end
    report(job_id, attempts, max_attempts, kind, count_of(job[5], 0))
  end
end

local stamped = 0
if limit > 0 then
  for _, job_id in ipairs(redis.call('LRANGE', landing_key, 0, limit - 1)) do
    local state = redis.call('HGET', job_prefix .. job_id, 'state')
    if ENDED_STATES[state] and not redis.call('ZSCORE', leases_key, job_id) then
      -- A stale copy of a job that already ended (a claim took it from
      -- queued after the id was left here): it leaves landing now. Leased,
      -- it would count again in its concurrency cap's running set (a slot
      -- held by a finished job) until that lease ran out.
      redis.call('LREM', landing_key, 1, job_id)
      local gen = redis.call('HGET', job_prefix .. job_id, 'gen') or '0'
      if state == 'cancelled' and redis.call('PTTL', job_prefix .. job_id) == -1 then
        leave_tombstone(job_id, 'cancelled', gen, tombstone_ms)
      end
      report(job_id, 0, 1, 'dropped', count_of(gen, 0))
    else
      stamped = stamped + redis.call('ZADD', leases_key, 'NX', now + lease_ms, job_id)
    end
  end
  -- The legacy processing list, a slice per call: each id moves into
  -- leases (keeping a lease it has), so it is recovered when that expires.
  for _, job_id in ipairs(redis.call('LPOP', processing_key, LEGACY_SLICE) or {}) do
    stamped = stamped + redis.call('ZADD', leases_key, 'NX', now + lease_ms, job_id)
  end
end

if requeued > 0 then
  push_wake_marker(wake_key)
end
return { outcomes, stamped }
