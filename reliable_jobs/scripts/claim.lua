--[[
  claim: move up to N jobs from queued into the leases set, stamping each one.

  KEYS[1] queued      list   ids ready to run (the oldest on the right)
  KEYS[2] leases      zset   id -> lease deadline (ms, server clock): the
                             in-flight index, every claimed and unacked id
  KEYS[3] dead        zset   id -> time of death (ms)
  KEYS[4] wake        list   at most one marker, pushed when work is left
  KEYS[5] job prefix  string job hashes are KEYS[5] .. id (same {queue} slot)
  KEYS[6] landing     list   ids a worker moved off queued with BLMOVE and
                             has not stamped yet (a few at most)
  KEYS[7] bands       zset   non-zero priorities with a non-empty band list
                             (member and score: the priority)
  KEYS[8] band prefix string the list of priority p is KEYS[8] .. p
  KEYS[9] share       string jobs claimed while several bands waited,
                             modulo share_every (the fair share's turn)
  KEYS[10] strays     zset   id -> copies reprioritize.lua left on a band
  KEYS[11] paused     string set while the queue is paused (pause.lua): the
                             claim takes nothing
  KEYS[12] flow prefix string a limit's keys are KEYS[12] .. 'log:' / 'tat:' /
                             'run:' / 'held:' .. its wire name (include flow_limit)
  KEYS[13] holds      zset   wire name of a limit with a held list -> when
                             (ms) it may let a job go
  KEYS[14] fair_bands zset   priorities (0 included) with a non-empty
                             rotation (member and score: the priority)
  KEYS[15] rota prefix string the rotation of priority p is KEYS[15] .. p:
                             zset fair group -> place in the turn order
                             ('' for p's plain list)
  KEYS[16] group prefix string group g's list at priority p: KEYS[16] .. p
                             .. ':' .. g
  KEYS[17] turn       hash   p -> jobs the head of p's rotation took in its
                             current turn

  ARGV[1] count     how many jobs to claim at most
  ARGV[2] lease_ms  lease length in milliseconds
  ARGV[3] moved_id  an id the worker already moved onto landing with BLMOVE
                    (stamped first, and moved into leases), or '' for
                    none; ignored when it is no longer on landing (a sweep
                    requeued it as an orphan while the worker stalled)
  ARGV[4] share_every  0: strict priority. n > 0: of every n jobs claimed
                    while more than one band waits, one is the job that has
                    waited longest (the oldest enqueued_ms at the head of a
                    band, the lower priority on a tie) whatever its
                    priority, so no band starves
  ARGV[5] exhausted_class  the class path that opens the error of a job
                    buried with no attempt left (the broker passes
                    exceptions.class_path(AttemptsExhausted), so the path
                    always names a class that exists)
  ARGV[6] queue_rate   the queue's rate limit: claims per window, 0 for none
  ARGV[7] queue_window_ms  the window of queue_rate in milliseconds
  ARGV[8] queue_cap    the queue's concurrency cap (its leases), 0 for none
  ARGV[9] weights   the fair groups' weights, 'group=weight' joined by
                    ',' ('' when none): a group takes that many jobs per
                    turn of its priority's rotation; unlisted groups and
                    the plain list take 1

  Pause: while KEYS[11] exists nothing is taken (a moved id goes back to
  the head of queued, no wake marker is pushed) and the reply says
  paused; a pause takes effect at the very next claim on the shard, and a
  claim that ran before it is caught by start.lua, which reads the same key.

  Flow control (docs/design.md): the queue's cap counts its leases, its rate
  a sliding log of claims, paced; allowance = min(count, cap - leases, the
  rate's room now).
  At no allowance nothing is taken (a moved id goes back to the head of
  queued). Limits due again in holds are served first, from their held
  lists; then the bands as above. A job whose payload names limits (a task's
  or a key's) is leased only when each lets it go, and is otherwise put on
  the held list of the limit that holds it, in order, its attempt untouched.

  Priorities: queued holds the jobs of priority 0, each other priority p
  (-100..100) has its own list KEYS[8] .. p, listed in bands while it is not
  empty. When bands is empty (a queue that only ever sees priority 0) the
  claim is exactly the single-list take below. Otherwise the bands are taken
  highest first, each from its right (FIFO within a priority), with band 0
  (queued) between the positive and the negative ones; a band found empty
  is taken off bands. Cost: O(bands in use), at most 201, never the queue's
  length.

  Fair groups: within a priority, jobs that carry a fair group wait on
  their group's list, and the priority's rotation (KEYS[15] .. p) lists the
  groups with jobs waiting, '' standing for the plain list (band_push.lua
  keeps it so). Taking n jobs from such a priority is weighted round robin:
  the head group of the rotation gives up to its weight (less what it gave
  already in this turn, KEYS[17]), then goes to the back; a group found
  empty leaves the rotation. So one group's 100,000 jobs delay another's
  by at most one turn of every group waiting. FIFO holds within a group.
  The fair share across priorities (ARGV[4]) compares the job each
  priority would give next. Cost: O(jobs taken + groups found empty) per
  priority, each step O(log groups); a queue with no fair group takes
  exactly the plain path above (plus one ZCARD).

  A copy of an id whose job is 'queued' at another priority than the band
  it came from (reprioritize.lua moved it and left this copy behind) is
  dropped; so is a copy with no hash that strays counts (its job finished
  since): each such drop takes one off the id's count in strays.

  Taking the batch with LRANGE + LTRIM and adding each claimed id to leases
  inside one script is the same atomic move as LMOVE, for many ids at once:
  an id is always on queued (or landing) or in leases, never in neither.
  leases is the in-flight index: an ack removes its id with ZREM, O(log n)
  in the jobs in flight, where LREM on a shared processing list walked
  past every older unacked id. Each claimed job gets attempts + 1 (the
  fencing token), state 'running' and a lease. A job whose attempts
  already reached max_attempts goes to dead instead (G3). An id with no
  job hash is garbage: it is moved aside to dead and reported. So is an id
  whose hash is damaged (no state, or a state no script writes), and the
  damaged hash is deleted, so that reconcile rebuilds the job from the
  database. A copy of an id whose job is not 'queued' is a stray and
  dropped: a 'running' job's own record is its entry in leases, which this
  script never touches for it. The id of a job cancelled while queued
  (state 'cancelled', see cancel.lua) is dropped, and its hash becomes a
  tombstone for CANCELLED_TOMBSTONE_MS (an hour, see the tombstone include):
  that is where a cancel takes effect, and a late push of the job is still
  refused after it.

  attempts, gen and max_attempts are read as whole numbers from 0 (1) to
  2^31 - 1 (the mirror's integer columns) whatever the hash holds, and
  attempts and gen are written back, so the token the fenced scripts compare
  always reads the same as the one returned.

  Returns: { jobs, dead, garbage, remaining, banded, hold_ms, hold_by_cap, paused }
    jobs      flat list: id, attempt, max_attempts, payload, gen, waited_ms
              (per job); attempt and gen together are the fencing token;
              waited_ms is how long the job was ready before this claim
              (see latency.lua), -1 when its hash holds no time
    dead      flat list: id, attempts, gen (jobs that had no attempt left)
    garbage   list of ids moved aside: no job hash, or a damaged one
    remaining jobs left on queued and every band after the claim (a fair
              group counts as 1 however many it holds: not 0 exactly when
              jobs are left)
    banded   how many non-zero bands, plus priorities with fair groups,
             were in use when the claim began (0: only priority 0's plain
             list was waiting; a worker that never saw more waits on this
             queue alone with BLMOVE)
    hold_ms  -1, or, when this call did nothing because limits held every
             job it could reach, how long (ms) until one may let a job go
    hold_by_cap  1 when hold_ms is a cap's guess (a slot may free at any
             moment: an ack does not say so), 0 when it is a rate's time
    paused   1 when the queue is paused (then everything else is empty,
             remaining 0 and hold_ms -1), else 0
  Errors: count, lease_ms, share_every or a queue limit not a whole number from 0 to 2^52,
  exhausted_class not a dotted path, or a fair weight not a whole number from 1
  to 1000 (nothing is written).
]]
local queued_key = KEYS[1]
local leases_key = KEYS[2]
local dead_key = KEYS[3]
local wake_key = KEYS[4]
local job_prefix = KEYS[5]
local landing_key = KEYS[6]
local bands_key = KEYS[7]
local band_prefix = KEYS[8]
local share_key = KEYS[9]
local strays_key = KEYS[10]
local paused_key = KEYS[11]
local flow_prefix = KEYS[12]
local holds_key = KEYS[13]
local fair_bands_key = KEYS[14]
local rota_prefix = KEYS[15]
local group_prefix = KEYS[16]
local turn_key = KEYS[17]

--- @include "wake_marker"

-- A whole number from ARGV, or an error reply before anything is written.
local function whole(value, name)
  local n = tonumber(value)
  if n == nil or n ~= math.floor(n) or n < 0 or n > 4503599627370496 then
    error({ err = 'ERR claim: ' .. name .. ' must be a whole number from 0 to 2^52, not '
      .. string.sub(tostring(value), 1, 40) })
  end
  return n
end

--- @include "count_of"

local KNOWN_STATES = {
  queued = true, running = true, scheduled = true, dead = true, finished = true, cancelled = true
}

local count = whole(ARGV[1], 'count')
local lease_ms = whole(ARGV[2], 'lease_ms')
local moved_id = ARGV[3] or ''
local share_every = whole(ARGV[4], 'share_every')
local exhausted_class = ARGV[5]
local queue_rate = whole(ARGV[6] or 0, 'queue_rate')
local queue_window_ms = whole(ARGV[7] or 0, 'queue_window_ms')
local queue_cap = whole(ARGV[8] or 0, 'queue_cap')
if type(exhausted_class) ~= 'string' or not string.match(exhausted_class, '^[%a_][%w_.]*$') then
  return redis.error_reply('ERR claim: exhausted_class must be a dotted class path')
end

-- Each listed group's weight; checked before anything is written.
local weights = {}
for group, weight in string.gmatch(ARGV[9] or '', '([^,=]+)=([^,]*)') do
  local w = tonumber(weight)
  if w == nil or w ~= math.floor(w) or w < 1 or w > 1000 then
    return redis.error_reply('ERR claim: a fair weight must be a whole number from 1 to 1000, not '
      .. string.sub(tostring(weight), 1, 40))
  end
  weights[group] = w
end

--- @include "band_of"

--- @include "stray"

--- @include "server_clock"

--- @include "tombstone"

--- @include "read_job"

-- Paused: take nothing. The moved id goes back where BLMOVE took it from,
-- and no marker is pushed (a paused queue's work must not wake anyone).
if redis.call('EXISTS', paused_key) == 1 then
  if moved_id ~= '' and redis.call('LREM', landing_key, 1, moved_id) > 0 then
    redis.call('RPUSH', queued_key, moved_id)
    -- Priority 0's plain list takes turns with fair groups: it has a job
    -- again, so it gets its turn back, first (its job was at the head).
    if redis.call('ZSCORE', fair_bands_key, 0)
        and not redis.call('ZSCORE', rota_prefix .. 0, '') then
      local first = redis.call('ZRANGE', rota_prefix .. 0, 0, 0, 'WITHSCORES')
      redis.call('ZADD', rota_prefix .. 0, (tonumber(first[2]) or 0) - 1, '')
    end
  end
  return { {}, {}, {}, 0, 0, -1, 0, 1 }
end

local now = now_ms()
local deadline_ms = now + lease_ms

--- @include "flow_limit"

local ids = {}
-- The band each id was taken from (by index in ids; absent: 0).
local came_from = {}
-- Ids a limit already let go (taken from a held list), by index in ids.
local admitted = {}
-- A moved id that is back on queued (a sweep requeued it as an orphan while
-- the worker stalled) is not taken: that copy is the one to run.
if moved_id ~= '' and redis.call('LREM', landing_key, 1, moved_id) > 0 then
  ids[1] = moved_id
end

-- The queue's own limits: how many jobs this call may lease at most, and
-- when (ms) the limit that bounds it may let more go.
local allowance = math.max(count, #ids)
local queue_free_at = nil
-- Whether queue_free_at is a cap's guess (a recheck) rather than a rate's time.
local queue_cap_guess = false
-- The queue's own rate log is flow_prefix .. 'log:' .. 'q'.
local queue_wire = 'q'
if queue_cap > 0 then
  local free = queue_cap - redis.call('ZCARD', leases_key)
  if free < allowance then
    allowance = math.max(free, 0)
    queue_free_at = now + FLOW_CAP_RECHECK_MS
    queue_cap_guess = true
  end
end
if queue_rate > 0 then
  local room, at = flow_rate_room(queue_wire, queue_rate, queue_window_ms)
  if room < allowance then
    allowance = room
    if room == 0 then
      if queue_free_at == nil or at < queue_free_at then
        queue_free_at, queue_cap_guess = at, false
      end
    end
  end
end
if allowance == 0 and #ids > 0 then
  -- At the queue's limit: the moved id goes back where BLMOVE took it from.
  redis.call('RPUSH', queued_key, ids[1])
  ids[1] = nil
end
count = allowance

-- Limits due again let their held jobs go first (they were ahead of
-- everything on the lists); bounded work: at most 4 * count + 16 steps.
local held_moved = 0
if count - #ids > 0 then
  local steps = 4 * count + 16
  for _, wire in ipairs(redis.call('ZRANGEBYSCORE', holds_key, '-inf', now, 'LIMIT', 0, 16)) do
    while steps > 0 and #ids < count do
      steps = steps - 1
      local head = redis.call('LINDEX', flow_prefix .. 'held:' .. wire, -1)
      if not head then
        redis.call('ZREM', holds_key, wire)
        break
      end
      local job = read_job(head, 'state', 'payload', 'priority')
      local limits = job[1] == 'queued' and flow_limits(flow_spec(job[2]) or '') or {}
      local blocker, retry_ms = nil, nil
      if #limits > 0 then
        blocker, retry_ms = flow_check(limits, wire)
      end
      if blocker == wire then
        redis.call('ZADD', holds_key, retry_ms, wire)
        break
      end
      redis.call('RPOP', flow_prefix .. 'held:' .. wire)
      if blocker ~= nil then
        -- Held by another of its limits now: it waits there instead.
        flow_hold(blocker, head, retry_ms)
        held_moved = held_moved + 1
      else
        -- Let go (or not queued any more: the loop below drops or buries it
        -- as it would on a list; it is no copy left by a reprioritize).
        ids[#ids + 1] = head
        came_from[#ids] = band_of(job[3])
        if #limits > 0 then
          flow_take(limits, head)
          admitted[#ids] = true
        end
      end
    end
    if steps <= 0 or #ids >= count then
      break
    end
  end
end
-- Priorities whose jobs wait in fair groups (a set; empty for most queues).
local grouped = {}
local fair_count = redis.call('ZCARD', fair_bands_key)
if fair_count > 0 then
  for _, member in ipairs(redis.call('ZRANGE', fair_bands_key, 0, -1)) do
    grouped[tonumber(member)] = true
  end
end

-- The list of a member of band's rotation ('' is the band's plain list) and
-- the head of it (the right end), or false when the rotation is empty.
local function rota_head(band)
  local head = redis.call('ZRANGE', rota_prefix .. band, 0, 0)
  if #head == 0 then
    return false
  end
  return head[1]
end

-- Take ids from the right of one list of band: the plain one for group ''.
local function take_list(band, group, n)
  local taken
  if group ~= '' then
    local member = band .. ':' .. group
    taken = redis.call('LRANGE', group_prefix .. member, -n, -1)
    if #taken > 0 then
      redis.call('LTRIM', group_prefix .. member, 0, -#taken - 1)
    end
    return taken, #taken < n or redis.call('LLEN', group_prefix .. member) == 0
  elseif band == 0 then
    taken = redis.call('LRANGE', queued_key, -n, -1)
    if #taken > 0 then
      redis.call('LTRIM', queued_key, 0, -#taken - 1)
    end
    return taken, #taken < n or redis.call('LLEN', queued_key) == 0
  end
  taken = redis.call('LRANGE', band_prefix .. band, -n, -1)
  if #taken > 0 then
    redis.call('LTRIM', band_prefix .. band, 0, -#taken - 1)
  end
  return taken, #taken < n or redis.call('LLEN', band_prefix .. band) == 0
end

-- Weighted round robin over band's rotation: up to n ids, in turn order.
local function take_fair(band, n)
  local got = 0
  local used = tonumber(redis.call('HGET', turn_key, band)) or 0
  while got < n do
    local group = rota_head(band)
    if not group then
      break
    end
    local weight = weights[group] or 1
    local want = math.max(1, math.min(n - got, weight - used))
    local taken, emptied = take_list(band, group, want)
    for i = #taken, 1, -1 do
      ids[#ids + 1] = taken[i]
      if band ~= 0 then
        came_from[#ids] = band
      end
    end
    got = got + #taken
    used = used + #taken
    if emptied then
      redis.call('ZREM', rota_prefix .. band, group)
      used = 0
    elseif used >= weight then
      local last = redis.call('ZRANGE', rota_prefix .. band, -1, -1, 'WITHSCORES')
      redis.call('ZADD', rota_prefix .. band, tonumber(last[2]) + 1, group)
      used = 0
    end
  end
  if used > 0 then
    redis.call('HSET', turn_key, band, used)
  else
    redis.call('HDEL', turn_key, band)
  end
  if redis.call('ZCARD', rota_prefix .. band) == 0 then
    redis.call('ZREM', fair_bands_key, band)
    grouped[band] = nil
  end
  return got
end

-- Take up to n (>= 1) ids from the right of a band's list (queued for 0),
-- or round robin from its fair groups; the loop below leases each one (or
-- drops or buries it) before the script ends; returns how many.
local function take(band, n)
  if grouped[band] then
    return take_fair(band, n)
  end
  local taken
  if band == 0 then
    taken = redis.call('LRANGE', queued_key, -n, -1)
    if #taken > 0 then
      redis.call('LTRIM', queued_key, 0, -#taken - 1)
    end
  else
    taken = redis.call('LRANGE', band_prefix .. band, -n, -1)
    if #taken > 0 then
      redis.call('LTRIM', band_prefix .. band, 0, -#taken - 1)
    end
  end
  if #taken > 0 then
    for i = #taken, 1, -1 do
      ids[#ids + 1] = taken[i]
      if band ~= 0 then
        came_from[#ids] = band
      end
    end
  end
  return #taken
end

-- The id at the head (the right) of a band's list, or false when empty;
-- for a band with fair groups, the id its next take would give first.
local function head_of(band)
  if grouped[band] then
    local group = rota_head(band)
    while group do
      local head
      if group ~= '' then
        local member = band .. ':' .. group
        head = redis.call('LINDEX', group_prefix .. member, -1)
      elseif band == 0 then
        head = redis.call('LINDEX', queued_key, -1)
      else
        head = redis.call('LINDEX', band_prefix .. band, -1)
      end
      if head then
        return head
      end
      -- A group left empty (a worker's BLMOVE took the plain list's last
      -- id): out of the rotation, as a take would do.
      redis.call('ZREM', rota_prefix .. band, group)
      redis.call('HDEL', turn_key, band)
      group = rota_head(band)
    end
    redis.call('ZREM', fair_bands_key, band)
    grouped[band] = nil
    return false
  end
  if band == 0 then
    return redis.call('LINDEX', queued_key, -1)
  end
  return redis.call('LINDEX', band_prefix .. band, -1)
end

local banded = redis.call('ZCARD', bands_key)
local wanted = count - #ids
local bands = nil
if wanted > 0 and banded == 0 and fair_count == 0 then
  take(0, wanted)
elseif wanted > 0 then
  -- Every band in use, highest first, band 0 (queued) among them.
  bands = {}
  for _, member in ipairs(redis.call('ZREVRANGEBYSCORE', bands_key, '+inf', '(0')) do
    bands[#bands + 1] = tonumber(member)
  end
  bands[#bands + 1] = 0
  for _, member in ipairs(redis.call('ZREVRANGEBYSCORE', bands_key, '(0', '-inf')) do
    bands[#bands + 1] = tonumber(member)
  end
  -- The fair share: the claims at every share_every-th place of the count
  -- go to the job that waited longest, one at a time.
  local fair = 0
  local turn = 0
  if share_every > 0 and #bands > 1 then
    turn = tonumber(redis.call('GET', share_key)) or 0
    fair = math.floor((turn + wanted) / share_every) - math.floor(turn / share_every)
  end
  local got = 0
  for _ = 1, fair do
    local oldest, oldest_ms = nil, nil
    for _, band in ipairs(bands) do
      local head = head_of(band)
      if head then
        -- (read_job: a head whose key is not a hash reads as 0, is taken
        -- first and moved aside as garbage below.)
        local ms = tonumber(read_job(head, 'enqueued_ms')[1]) or 0
        -- Bands go highest first: on a tie (the same ms) the lower one wins.
        if oldest_ms == nil or ms <= oldest_ms then
          oldest, oldest_ms = band, ms
        end
      end
    end
    if oldest == nil then
      break
    end
    got = got + take(oldest, 1)
  end
  for _, band in ipairs(bands) do
    if got >= wanted then
      break
    end
    got = got + take(band, wanted - got)
  end
  for _, band in ipairs(bands) do
    if band ~= 0 and not grouped[band] and redis.call('LLEN', band_prefix .. band) == 0 then
      redis.call('ZREM', bands_key, band)
    end
  end
  if share_every > 0 and #bands > 1 then
    redis.call('SET', share_key, (turn + got) % share_every)
  end
end

-- Lease job_id under its limits when they all let it go (taking a slot
-- of each), else put it on the held list of the first that holds it.
local function flow_admit(job_id, payload)
  local spec = flow_spec(payload)
  if spec == nil then
    return true
  end
  local limits = flow_limits(spec)
  local blocker, retry_ms = flow_check(limits, nil)
  if blocker ~= nil then
    flow_hold(blocker, job_id, retry_ms)
    return false
  end
  flow_take(limits, job_id)
  return true
end

local jobs, dead, garbage, lease_args = {}, {}, {}, {}
for index, job_id in ipairs(ids) do
  local job_key = job_prefix .. job_id
  -- A key of another type under a job's name reads as a damaged hash
  -- (read_job): the id is garbage, never an error that would end this script
  -- after the ids it took off their lists.
  local job = read_job(job_id, 'state', 'attempts', 'max_attempts', 'payload', 'gen',
    'ready_ms', 'enqueued_ms', 'priority')
  local gen = count_of(job[5], 0)
  if job[1] == false and consume_stray(job_id) then
    -- A copy left behind by a reprioritize whose job has finished since:
    -- dropped (consume_stray counted it).
  elseif job[1] == 'queued' and band_of(job[8]) ~= (came_from[index] or 0) then
    -- A copy left behind by a reprioritize: the job waits on another band.
    consume_stray(job_id)
  elseif not KNOWN_STATES[job[1]] then
    -- No hash, or a damaged one: the database still has the job, and
    -- reconcile pushes it again once its hash is gone.
    redis.call('DEL', job_key)
    redis.call('ZADD', dead_key, now, job_id)
    garbage[#garbage + 1] = job_id
  elseif job[1] == 'cancelled' then
    -- Cancelled while queued (cancel.lua marks the whole hash, no expiry):
    -- its id is dropped here, and its hash cut down to a tombstone that
    -- lives as long as a scheduled or running job's, so a late push of it
    -- is still refused. A tombstone that already expires is left as it is.
    if redis.call('PTTL', job_key) == -1 then
      leave_tombstone(job_id, 'cancelled', job[5] or '0', CANCELLED_TOMBSTONE_MS)
    end
  elseif job[1] ~= 'queued' then
    -- A stray second copy of a job that lives elsewhere (a running job's
    -- record is its lease): dropped.
    consume_stray(job_id)
  else
    local attempts = count_of(job[2], 0)
    local max_attempts = count_of(job[3], 1)
    if attempts >= max_attempts then
      redis.call('ZADD', dead_key, now, job_id)
      redis.call('HSET', job_key, 'state', 'dead', 'finished_ms', now, 'last_error',
        exhausted_class .. ': claimed ' .. attempts .. ' of ' .. max_attempts ..
        ' times without finishing (worker lost or lease expired)')
      dead[#dead + 1] = job_id
      dead[#dead + 1] = attempts
      dead[#dead + 1] = gen
    elseif job[4] and string.byte(job[4], 3) == 102 and not admitted[index]
        and not flow_admit(job_id, job[4]) then
      -- (byte 3 is the 'f' of a payload that opens with its limits: flow_spec)
      -- Held by one of its limits (flow_admit put it on that limit's held
      -- list): still queued, its attempt untouched.
      held_moved = held_moved + 1
    else
      attempts = attempts + 1
      if queue_rate > 0 then
        flow_rate_take(queue_wire, queue_rate, queue_window_ms, job_id)
      end
      redis.call('HSET', job_key, 'state', 'running', 'attempts', attempts, 'gen', gen,
        'started_ms', now)
      lease_args[#lease_args + 1] = deadline_ms
      lease_args[#lease_args + 1] = job_id
      jobs[#jobs + 1] = job_id
      jobs[#jobs + 1] = attempts
      jobs[#jobs + 1] = max_attempts
      jobs[#jobs + 1] = job[4] or ''
      jobs[#jobs + 1] = gen
      local ready_ms = tonumber(job[6]) or tonumber(job[7])
      jobs[#jobs + 1] = ready_ms and math.max(0, now - ready_ms) or -1
    end
  end
end
for i = 1, #lease_args, 1000 do
  redis.call('ZADD', leases_key, unpack(lease_args, i, math.min(i + 999, #lease_args)))
end

local remaining = redis.call('LLEN', queued_key)
for band in pairs(grouped) do
  -- Each group waiting counts 1 (its length would cost a call per group).
  remaining = remaining + redis.call('ZCARD', rota_prefix .. band)
  if redis.call('ZSCORE', rota_prefix .. band, '') then
    remaining = remaining - 1
  end
end
if bands ~= nil then
  for _, band in ipairs(bands) do
    if band ~= 0 then
      remaining = remaining + redis.call('LLEN', band_prefix .. band)
    end
  end
elseif banded > 0 then
  -- Nothing was wanted (count 0): count the bands all the same.
  for _, member in ipairs(redis.call('ZRANGE', bands_key, 0, -1)) do
    remaining = remaining + redis.call('LLEN', band_prefix .. member)
  end
end
if remaining > 0 then
  push_wake_marker(wake_key)
end
-- Nothing done because limits held everything in reach: say when to come back.
local hold_ms, hold_by_cap = -1, 0
if #jobs == 0 and #dead == 0 and #garbage == 0 and held_moved == 0 then
  local due, by_cap = queue_free_at, queue_cap_guess
  if remaining == 0 or due == nil then
    local first = redis.call('ZRANGE', holds_key, 0, 0, 'WITHSCORES')
    if first[2] and (due == nil or tonumber(first[2]) < due) then
      due, by_cap = tonumber(first[2]), string.sub(first[1], 1, 2) == 'c:'
    end
  end
  if due ~= nil then
    hold_ms = math.max(due - now, 0)
    hold_by_cap = by_cap and 1 or 0
  end
end
return { jobs, dead, garbage, remaining, banded + fair_count, hold_ms, hold_by_cap, 0 }
