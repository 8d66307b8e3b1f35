-- Sliding log (kind "sl"): p1 = limit, p2 = window, in microseconds. The state key is a
-- sorted set of admitted requests (score: time; member: "sequence:units", unique even
-- within one microsecond); the auxiliary key a hash with the units in the log (t) and the
-- sequence (s). At most `limit` members, since every member holds at least one unit.
-- The state read once per call: both counters (one HMGET) and the oldest entry, which says
-- whether any entry left the window (else no ZRANGEBYSCORE) and, kept up to date by a
-- commit, gives the snapshot its effective window. Mirrors src/algorithm/sliding_log.rs.

-- The oldest entry's time (nil: the log is empty), as ZRANGE answers it.
local function oldest_of(key)
  local oldest = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
  if #oldest > 0 then return tonumber(oldest[2]) end
  return nil
end

local function load(p, key, aux)
  -- 'pb': a penalty's field (prelude.lua), present only in a hash that holds a penalty.
  local stored = redis.call('HMGET', aux, 't', 's', 'pb')
  local s = {
    key = key, aux = aux, total = num(stored[1], 0), sequence = num(stored[2], 0),
    penalized = stored[3] ~= false,
  }
  -- The oldest entry: whether any left the window, and the snapshot's effective window.
  s.oldest = oldest_of(key)
  -- The log expired as a whole (its hash may outlive it, holding a penalty): it is empty.
  if s.total > 0 and s.oldest == nil then
    s.total = 0
    redis.call('HSET', aux, 't', 0)
  end
  local horizon = now - p[2]
  if s.oldest ~= nil and s.oldest <= horizon then
    local expired = redis.call('ZRANGEBYSCORE', key, '-inf', horizon)
    for _, member in ipairs(expired) do
      s.total = s.total - tonumber(string.match(member, ':(%d+)$'))
    end
    redis.call('ZREMRANGEBYSCORE', key, '-inf', horizon)
    if s.total < 0 then s.total = 0 end
    redis.call('HSET', aux, 't', s.total)
    s.oldest = oldest_of(key)
  end
  return s
end

local function check(p, s)
  if cost > p[1] then return 'never' end
  if s.total + cost <= p[1] then return 'admit', 0 end
  -- Wait until enough of the oldest entries have left the window.
  local needed = s.total + cost - p[1]
  local freed = 0
  local entries = redis.call('ZRANGE', s.key, 0, -1, 'WITHSCORES')
  for i = 1, #entries, 2 do
    freed = freed + tonumber(string.match(entries[i], ':(%d+)$'))
    if freed >= needed then
      return 'deny', tonumber(entries[i + 1]) + p[2] - now
    end
  end
  return 'deny', p[2]
end

local function commit(p, s)
  s.sequence = s.sequence + 1
  -- %d: a concatenated number would print as 1e+14 past 14 digits.
  redis.call('ZADD', s.key, now, string.format('%d:%d', s.sequence, cost))
  s.total = s.total + cost
  s.newest = now
  if s.oldest == nil or now < s.oldest then s.oldest = now end
  redis.call('HSET', s.aux, 't', s.total, 's', s.sequence)
  local ttl = cdiv(p[2], 1000) + 1
  redis.call('PEXPIRE', s.key, ttl)
  -- A hash that holds a penalty may have to outlive the log; one that holds only the
  -- counters was set to expire with it, never later than this.
  if s.penalized then extend_ttl(s.aux, ttl) else redis.call('PEXPIRE', s.aux, ttl) end
end

-- Gives back up to `units` recorded at `at` (what has left the window is gone); at -1:
-- any, the newest entries first.
local function refund(p, s, units, at)
  local members
  if at >= 0 then
    members = redis.call('ZRANGEBYSCORE', s.key, at, at, 'WITHSCORES')
  else
    members = redis.call('ZRANGE', s.key, 0, -1, 'WITHSCORES')
  end
  for i = #members - 1, 1, -2 do
    if units <= 0 then break end
    local sequence, held = string.match(members[i], '^(%d+):(%d+)$')
    held = tonumber(held)
    local taken = math.min(units, held)
    -- The smaller entry goes in before the old one goes: removing a log's only entry
    -- first would delete the key, and the ZADD would make it again without a TTL.
    if held > taken then
      redis.call('ZADD', s.key, members[i + 1], string.format('%s:%d', sequence, held - taken))
    end
    redis.call('ZREM', s.key, members[i])
    units = units - taken
    s.total = s.total - taken
  end
  -- Nothing given back: nothing to write (the log may have expired, and a write would
  -- bring its hash back without a TTL).
  if #members == 0 then return end
  redis.call('HSET', s.aux, 't', s.total)
  s.oldest = oldest_of(s.key)
end

local function snapshot(p, s)
  local newest = s.newest
  if newest == nil then
    local last = redis.call('ZRANGE', s.key, -1, -1, 'WITHSCORES')
    if #last > 0 then newest = tonumber(last[2]) end
  end
  local reset = 0
  if newest ~= nil then reset = math.max(newest + p[2] - now, 0) end
  -- Effective window: until the oldest counted entry leaves (a whole window when empty).
  local effective = p[2]
  if s.oldest ~= nil then effective = math.max(s.oldest + p[2] - now, 1) end
  return p[1], math.max(p[1] - s.total, 0), reset, effective
end

-- No `one` (a path of its own for one policy): main.lua decides a lone log through the
-- functions above and reports the full status.
