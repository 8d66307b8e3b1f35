-- Sliding log (kind "sl"): p1 = limit, p2 = window, in microseconds; p3 = 2, the layout
-- of its state (part of the key's name, so a key of another layout is never read). The
-- state key is one sorted set: the admitted requests (score: their time, never negative;
-- member: "sequence:units", unique even within one microsecond) and two counters kept as
-- negative scores, member 't' (-1 - the units in the log) and member 's' (-1 - the last
-- sequence). The three lowest scores are both counters and the oldest entry: one ZRANGE
-- reads them. At most `limit` entries, since every entry holds at least one unit; the
-- log's auxiliary key holds only a penalty's state. Mirrors src/algorithm/sliding_log.rs.

-- The units of an entry's member.
local function units_of(member)
  return tonumber(string.match(member, ':(%d+)$'))
end

-- The oldest entry's time and member (nil: no entry).
local function oldest_of(key)
  local first = redis.call('ZRANGEBYSCORE', key, 0, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
  if #first > 0 then return tonumber(first[2]), first[1] end
  return nil, nil
end

-- The newest entry's time (nil: no entry; the highest score is then a counter's).
local function newest_of(key)
  local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if #last > 0 and tonumber(last[2]) >= 0 then return tonumber(last[2]) end
  return nil
end

-- The log at `key` brought up to now (the entries older than the window removed): the
-- units it holds, its last sequence, and its oldest entry's time (nil: empty) and member.
local function read_log(key, window)
  local total, sequence, oldest, first = 0, 0, nil, nil
  local low = redis.call('ZRANGE', key, 0, 2, 'WITHSCORES')
  for i = 1, #low, 2 do
    local member, score = low[i], tonumber(low[i + 1])
    if member == 't' then
      total = -1 - score
    elseif member == 's' then
      sequence = -1 - score
    elseif oldest == nil then
      oldest, first = score, member
    end
  end
  if oldest == nil then return 0, sequence, nil, nil end
  local horizon = now - window
  if oldest <= horizon then
    for _, member in ipairs(redis.call('ZRANGEBYSCORE', key, 0, horizon)) do
      total = total - units_of(member)
    end
    total = math.max(total, 0)
    -- The counter first: the key keeps a member (and its TTL) whatever the removal leaves.
    redis.call('ZADD', key, -1 - total, 't')
    redis.call('ZREMRANGEBYSCORE', key, 0, horizon)
    oldest, first = oldest_of(key)
    if oldest == nil then total = 0 end
  end
  return total, sequence, oldest, first
end

-- Whether `cost` fits a log holding `total` of a limit of p1, whose oldest entry (at
-- `oldest`) is the member `first`: 'admit', 'deny' (and the wait until enough of the
-- oldest entries have left the window) or 'never'.
local function fits(key, p1, p2, total, oldest, first)
  if cost > p1 then return 'never', 0 end
  if total + cost <= p1 then return 'admit', 0 end
  local needed = total + cost - p1
  -- The oldest entry frees enough (a one-unit request to a full log: what a client
  -- hammering its limit sends): no need to read the whole log for it.
  if oldest ~= nil and needed <= units_of(first) then return 'deny', oldest + p2 - now end
  local freed = 0
  local entries = redis.call('ZRANGEBYSCORE', key, 0, '+inf', 'WITHSCORES')
  for i = 1, #entries, 2 do
    freed = freed + units_of(entries[i])
    if freed >= needed then
      return 'deny', tonumber(entries[i + 1]) + p2 - now
    end
  end
  return 'deny', p2
end

-- Records `cost` units at now as entry `sequence`, with the counters, in one ZADD; the log
-- expires a window after its newest entry.
local function write_log(key, p2, total, sequence)
  -- %d: a concatenated number would print as 1e+14 past 14 digits.
  redis.call('ZADD', key, now, string.format('%d:%d', sequence, cost), -1 - total, 't',
    -1 - sequence, 's')
  redis.call('PEXPIRE', key, cdiv(p2, 1000) + 1)
end

local function load(p, key)
  local total, sequence, oldest, first = read_log(key, p[2])
  return { key = key, total = total, sequence = sequence, oldest = oldest, first = first }
end

local function check(p, s)
  return fits(s.key, p[1], p[2], s.total, s.oldest, s.first)
end

local function commit(p, s)
  s.sequence = s.sequence + 1
  s.total = s.total + cost
  write_log(s.key, p[2], s.total, s.sequence)
  s.newest = now
  if s.oldest == nil or now < s.oldest then
    s.oldest, s.first = now, string.format('%d:%d', s.sequence, cost)
  end
end

-- Gives back up to `units` recorded at `at` (what has left the window is gone); at -1:
-- any, the newest entries first.
local function refund(p, s, units, at)
  local members
  if at >= 0 then
    members = redis.call('ZRANGEBYSCORE', s.key, at, at, 'WITHSCORES')
  else
    members = redis.call('ZRANGEBYSCORE', s.key, 0, '+inf', 'WITHSCORES')
  end
  -- Nothing to give back: nothing to write (the log may have expired, and a write would
  -- bring it back without a TTL).
  if #members == 0 then return end
  for i = #members - 1, 1, -2 do
    if units <= 0 then break end
    local sequence, held = string.match(members[i], '^(%d+):(%d+)$')
    held = tonumber(held)
    local taken = math.min(units, held)
    if held > taken then
      redis.call('ZADD', s.key, members[i + 1], string.format('%s:%d', sequence, held - taken))
    end
    redis.call('ZREM', s.key, members[i])
    units = units - taken
    s.total = s.total - taken
  end
  -- The counters keep the key alive (and its TTL) even when no entry is left.
  redis.call('ZADD', s.key, -1 - s.total, 't')
  s.oldest, s.first = oldest_of(s.key)
end

local function snapshot(p, s)
  local newest = s.newest
  if newest == nil then newest = newest_of(s.key) end
  local reset = 0
  if newest ~= nil then reset = math.max(newest + p[2] - now, 0) end
  -- Effective window: until the oldest counted entry leaves (a whole window when empty).
  local effective = p[2]
  if s.oldest ~= nil then effective = math.max(s.oldest + p[2] - now, 1) end
  return p[1], math.max(p[1] - s.total, 0), reset, effective
end

-- One plain policy (main.lua's fast path, with the policy's arguments as sent): {outcome,
-- wait, units in the log, oldest entry, newest entry, now}, a missing entry as -1.
local function one(key, p1, p2)
  p1, p2 = tonumber(p1), tonumber(p2)
  local total, sequence, oldest, first = read_log(key, p2)
  local verdict, value = fits(key, p1, p2, total, oldest, first)
  if verdict == 'admit' and cost > 0 then
    total = total + cost
    write_log(key, p2, total, sequence + 1)
    -- The new entry is the oldest when every other one is later (time stepped back).
    if oldest == nil or now < oldest then oldest = now end
    return { 0, 0, total, oldest, now, now }
  end
  local outcome = 0
  if verdict == 'deny' then outcome = 1 elseif verdict == 'never' then outcome = 2 end
  return { outcome, value, total, oldest or -1, newest_of(key) or -1, now }
end
