-- Sliding log (kind "sl"): p1 = limit, p2 = window, in microseconds; p3 = 3, the layout
-- of its state (part of the key's name, so a key of another layout is never read). The
-- state key is one sorted set of the admitted requests (score: their time, never
-- negative), so a request of one unit, the common case, writes one member and nothing
-- else. A member is unique and starts with its entry's time: the time alone for one unit
-- ("<time>"), else "<time>:<units>:<n>" (also what a partial refund leaves of an entry),
-- n telling entries of one microsecond apart. The units beyond one per entry are the
-- counter member 'x', scored minus their sum, so below every entry; it is there only
-- while some entry holds more than one unit, and the log holds its entries' count plus
-- them. The lowest member is the oldest entry, or the counter: one ZRANGE of one member
-- (no score to format) reads a log of one-unit entries. At most `limit` entries, since
-- every entry holds at least one unit; the log's auxiliary key holds only a penalty's
-- state. Mirrors src/algorithm/sliding_log.rs.

-- An entry's time and units, from its member: "<time>" (one unit) or
-- "<time>:<units>:<n>". A member of any other form is not tollgate's (another client
-- wrote into its keys): the script fails, loudly, through the store's failure mode,
-- rather than count a log it cannot read.
local function entry_of(member)
  local time = match(member, '^%d+$')
  if time then return tonumber(time), 1 end
  local units
  time, units = match(member, '^(%d+):(%d+):%d+$')
  if time then return tonumber(time), tonumber(units) end
  error('tollgate: a sliding log holds a member tollgate did not write')
end
local function time_of(member)
  local time = entry_of(member)
  return time
end
local function units_of(member)
  local _, units = entry_of(member)
  return units
end

-- The last time an entry was added (to any log) by this library, or this run of a
-- script, and how many entries were added at it since: the next entry of that
-- microsecond tries the next `n` first, so a batch of one microsecond never retries.
-- ZADD NX still decides: an entry of an earlier call may hold a name.
local stamp, stamped = -1, 0

-- Adds an entry of `units` at `at`, under a member no other entry holds.
local function add_entry(key, at, units)
  if at == stamp then stamped = stamped + 1 else stamp, stamped = at, 0 end
  -- The time's digits (an integer below 2^53) are the score, and a one-unit entry's
  -- member: what `%.17g` would spell, at a fraction of its cost (prelude.lua).
  local score = format('%d', at)
  local member = score
  if units > 1 or stamped > 0 then member = format('%d:%d:%d', at, units, stamped) end
  while call('ZADD', key, 'NX', score, member) == 0 do
    stamped = stamped + 1
    member = format('%d:%d:%d', at, units, stamped)
  end
end

-- Sets the units beyond one per entry (none: no counter member).
local function write_extra(key, extra)
  if extra > 0 then
    call('ZADD', key, -extra, 'x')
  else
    call('ZREM', key, 'x')
  end
end

-- The oldest entry's time and member (nil: no entry).
local function oldest_of(key)
  local first = call('ZRANGEBYSCORE', key, '0', '+inf', 'LIMIT', '0', '1')[1]
  if first then return time_of(first), first end
  return nil, nil
end

-- The newest entry's time (nil: no entry; the highest member is then the counter).
local function newest_of(key)
  local last = call('ZRANGE', key, '-1', '-1')[1]
  if last and last ~= 'x' then return time_of(last) end
  return nil
end

-- The log at `key` brought up to now (the entries older than the window removed): the
-- units it holds, the units beyond one per entry, and its oldest entry's time (nil:
-- empty) and member.
local function read_from(key, window, first)
  local extra = 0
  if first == 'x' then
    local low = call('ZRANGE', key, '0', '1', 'WITHSCORES')
    extra, first = -tonumber(low[2]), low[3]
    -- The counter is scored below every entry; one at 0 or above is not tollgate's.
    if not (extra > 0) then
      error('tollgate: a sliding log holds a counter tollgate did not write')
    end
  end
  -- A one-unit entry's member is its time, in digits. Anything else that reads as a
  -- whole number ('1e5', '0x10') is taken for its time too, and is only checked once
  -- that time says it has left the window: its score must then agree (a member whose
  -- score is old too goes with the rest). Only a client writing into tollgate's keys can
  -- put such a member there.
  local oldest = first and tonumber(first)
  if first and not (oldest and oldest >= 0 and oldest % 1 == 0) then oldest = time_of(first) end
  local horizon = now - window
  if oldest and oldest <= horizon then
    local upto = format('%d', horizon)
    local left = extra
    if extra > 0 then
      for _, member in ipairs(call('ZRANGEBYSCORE', key, '0', upto)) do
        left = left - units_of(member) + 1
      end
    end
    -- The oldest entry's time is its score: it goes, or the member only looks like ours.
    if call('ZREMRANGEBYSCORE', key, '0', upto) == 0 then
      error('tollgate: a sliding log holds a member tollgate did not write')
    end
    if left ~= extra then
      extra = max(left, 0)
      write_extra(key, extra)
    end
    oldest, first = oldest_of(key)
  end
  if oldest == nil then
    -- No entry holds extra units: a counter left alone would count them still.
    if extra > 0 then call('ZREM', key, 'x') end
    return 0, 0, nil, nil
  end
  local entries = call('ZCARD', key)
  if extra > 0 then entries = entries - 1 end
  return entries + extra, extra, oldest, first
end

-- The log read from its lowest member: the oldest entry, or the counter (then the entry
-- comes next).
local function read_log(key, window)
  return read_from(key, window, call('ZRANGE', key, '0', '0')[1])
end

-- The most entries of several units a costly request's wait reads (as
-- src/algorithm/sliding_log.rs's WALK).
local WALK = 256

-- Whether `cost` (or `units`, when given) fits a log holding `total` of a limit of p1,
-- whose oldest entry (at `oldest`) is the member `first`: 'admit', 'deny' (and the wait
-- until enough of the oldest entries have left the window) or 'never'.
local function fits(key, p1, p2, total, oldest, first, extra, units)
  local cost = units or cost
  if cost > p1 then return 'never', 0 end
  if total + cost <= p1 then return 'admit', 0 end
  local needed = total + cost - p1
  -- The oldest entry frees enough (a one-unit request to a full log: what a client
  -- hammering its limit sends): no need to read the whole log for it.
  if oldest ~= nil and needed <= units_of(first) then return 'deny', oldest + p2 - now end
  -- One unit an entry (no counter): the `needed`-th oldest entry frees enough, read by
  -- its rank in O(log n) rather than walking a log a client filled (a costly request
  -- to a full log of a large limit would walk it all, on the server every replica uses).
  if extra == 0 then
    local member = call('ZRANGE', key, needed - 1, needed - 1)[1]
    if member then return 'deny', time_of(member) + p2 - now end
    return 'deny', p2
  end
  -- Entries of several units: the oldest are read, at most WALK of them (ranked from 1:
  -- the counter member is the lowest), so the work stays bounded whatever the limit.
  local freed = 0
  local read = call('ZRANGE', key, 1, min(needed, WALK))
  for _, member in ipairs(read) do
    local time, units = entry_of(member)
    freed = freed + units
    if freed >= needed then return 'deny', time + p2 - now end
  end
  if #read < WALK then return 'deny', p2 end
  -- Past them every entry frees a unit at least: the (needed - freed)-th next one frees
  -- enough, whatever the ones between hold (an upper bound of the wait), else the newest.
  local past = call('ZRANGE', key, WALK + needed - freed, WALK + needed - freed)[1]
  if past == nil then past = call('ZRANGE', key, -1, -1)[1] end
  if past == nil or past == 'x' then return 'deny', p2 end
  return 'deny', time_of(past) + p2 - now
end

-- In a log a settle charged past its limit (total above p1), the wait until one unit
-- fits (at least 1): the effective window, which the oldest entry's leaving does not end.
local function unit_wait(key, p1, p2, total, oldest, first, extra)
  local _, wait = fits(key, p1, p2, total, oldest, first, extra, 1)
  return max(wait, 1)
end

-- Sets the log at `key` to expire a window after its newest entry, with one written now
-- (`grown`: the log held others before it). That is now's entry, unless time stepped
-- back (a failover, a clock step) and an earlier write is later: expired a window after
-- now, the log would go while its later entries still count. Returns the newest entry's
-- time.
local function expire_log(key, p2, grown)
  local newest = now
  if grown then newest = max(newest_of(key) or now, now) end
  call('PEXPIRE', key, cdiv(newest + p2 - now, 1000) + 1)
  return newest
end

-- Records `cost` units at now (and, for more than one, the counter); the log expires a
-- window after its newest entry. Returns the units beyond one per entry, and the newest
-- entry's time.
local function write_log(key, p2, extra, grown)
  add_entry(key, now, cost)
  if cost > 1 then
    extra = extra + cost - 1
    call('ZADD', key, 'INCR', 1 - cost, 'x')
  end
  return extra, expire_log(key, p2, grown)
end

local function load(p, key)
  local total, extra, oldest, first = read_log(key, p[2])
  return { key = key, total = total, extra = extra, oldest = oldest, first = first }
end

local function check(p, s)
  return fits(s.key, p[1], p[2], s.total, s.oldest, s.first, s.extra)
end

local function commit(p, s)
  s.extra, s.newest = write_log(s.key, p[2], s.extra, s.first ~= nil)
  s.total = s.total + cost
  if s.oldest == nil or now < s.oldest then
    s.oldest, s.first = now, format('%d:%d:0', now, cost)
  end
end

-- Gives back up to `units` recorded at `at` (what has left the window is gone); at -1:
-- any, the newest entries first.
local function refund(p, s, units, at)
  if units <= 0 then return end
  local members
  if at >= 0 then
    local time = format('%d', at)
    members = call('ZRANGEBYSCORE', s.key, time, time)
  else
    -- The newest, by rank: as many as could hold the units (each holds one at least),
    -- not the whole log. The counter member, the lowest, is among them only when the
    -- log is that short.
    members = call('ZRANGE', s.key, -units, -1)
  end
  -- Nothing to give back: nothing to write (the log may have expired, and a write would
  -- bring it back without a TTL).
  local lowest = 1
  if members[1] == 'x' then lowest = 2 end
  if #members < lowest then return end
  local extra = s.extra
  for i = #members, lowest, -1 do
    if units <= 0 then break end
    local member = members[i]
    local time, held = entry_of(member)
    local taken = min(units, held)
    call('ZREM', s.key, member)
    extra = extra - (held - 1)
    if held > taken then
      add_entry(s.key, time, held - taken)
      extra = extra + held - taken - 1
    end
    units = units - taken
    s.total = s.total - taken
  end
  if extra ~= s.extra then
    s.extra = extra
    write_extra(s.key, extra)
  end
  s.oldest, s.first = oldest_of(s.key)
end

local function snapshot(p, s)
  local newest = s.newest
  if newest == nil then newest = newest_of(s.key) end
  local reset = 0
  if newest ~= nil then reset = max(newest + p[2] - now, 0) end
  -- Effective window: until the oldest counted entry leaves (a whole window when empty),
  -- or, in a log a settle charged past its limit, until a unit fits.
  local effective = p[2]
  if s.total > p[1] then
    effective = unit_wait(s.key, p[1], p[2], s.total, s.oldest, s.first, s.extra)
  elseif s.oldest ~= nil then
    effective = max(s.oldest + p[2] - now, 1)
  end
  return p[1], max(p[1] - s.total, 0), reset, effective, max(s.total - p[1], 0)
end

-- One plain policy (main.lua's and one.lua's path, with the policy's arguments as sent):
-- {outcome, wait, units in the log, oldest entry, newest entry, now}, a missing entry as
-- -1.
local function one(key, p1, p2)
  p1, p2 = tonumber(p1), tonumber(p2)
  local first = call('ZRANGE', key, '0', '0')[1] -- as read_log reads it
  local oldest = first and tonumber(first)
  local total, extra
  -- What read_from answers, without its calls, for the two common logs: an empty one,
  -- and one whose oldest entry is a one-unit entry (its member its time, in digits) still
  -- in the window, and so without a counter.
  if first == nil then
    total, extra = 0, 0
  elseif oldest and oldest > now - p2 and oldest >= 0 and oldest % 1 == 0 then
    total, extra = call('ZCARD', key), 0
  else
    total, extra, oldest, first = read_from(key, p2, first)
  end
  -- What fits and write_log do, without their calls, for a one-unit request that fits
  -- (total < p1: the log holds a unit less than the limit at most).
  if cost == 1 and total < p1 then
    add_entry(key, now, 1)
    local newest = expire_log(key, p2, first ~= nil)
    if oldest == nil or now < oldest then oldest = now end
    return { 0, 0, total + 1, oldest, newest, now }
  end
  local verdict, value = fits(key, p1, p2, total, oldest, first, extra)
  if verdict == 'admit' and cost > 0 then
    local _, newest = write_log(key, p2, extra, first ~= nil)
    -- The new entry is the oldest when every other one is later (time stepped back).
    if oldest == nil or now < oldest then oldest = now end
    return { 0, 0, total + cost, oldest, newest, now }
  end
  local outcome = 0
  if verdict == 'deny' then outcome = 1 elseif verdict == 'never' then outcome = 2 end
  -- A log a settle charged past its limit: the entry reported as the oldest is the one
  -- whose leaving lets a unit fit, as the effective window of snapshot (only a refusal
  -- meets such a log: an admission leaves the log within its limit).
  if total > p1 then oldest = now + unit_wait(key, p1, p2, total, oldest, first, extra) - p2 end
  return { outcome, value, total, oldest or -1, newest_of(key) or -1, now }
end
