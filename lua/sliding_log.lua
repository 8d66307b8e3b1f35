-- Sliding log (kind "sl"): p1 = limit, p2 = window, in microseconds. The state key is a
-- sorted set of admitted requests (score: time; member: "sequence:units", unique even
-- within one microsecond); the auxiliary key a hash with the units in the log (t) and the
-- sequence (s). At most `limit` members, since every member holds at least one unit.
-- Mirrors src/algorithm/sliding_log.rs.

local function load(p, key, aux)
  local s = { key = key, aux = aux, total = num(redis.call('HGET', aux, 't'), 0) }
  -- The log expired as a whole (its hash may outlive it, holding a penalty): it is empty.
  if s.total > 0 and redis.call('EXISTS', key) == 0 then
    s.total = 0
    redis.call('HSET', aux, 't', 0)
  end
  local horizon = now - p[2]
  local expired = redis.call('ZRANGEBYSCORE', key, '-inf', horizon)
  if #expired > 0 then
    for _, member in ipairs(expired) do
      s.total = s.total - tonumber(string.match(member, ':(%d+)$'))
    end
    redis.call('ZREMRANGEBYSCORE', key, '-inf', horizon)
    if s.total < 0 then s.total = 0 end
    redis.call('HSET', aux, 't', s.total)
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
  local sequence = redis.call('HINCRBY', s.aux, 's', 1)
  -- %d: a concatenated number would print as 1e+14 past 14 digits.
  redis.call('ZADD', s.key, now, string.format('%d:%d', sequence, cost))
  s.total = s.total + cost
  s.newest = now
  redis.call('HSET', s.aux, 't', s.total)
  local ttl = cdiv(p[2], 1000) + 1
  redis.call('PEXPIRE', s.key, ttl)
  -- The hash may hold a penalty that must outlive the log.
  extend_ttl(s.aux, ttl)
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
    redis.call('ZREM', s.key, members[i])
    if held > taken then
      redis.call('ZADD', s.key, members[i + 1], string.format('%s:%d', sequence, held - taken))
    end
    units = units - taken
    s.total = s.total - taken
  end
  redis.call('HSET', s.aux, 't', s.total)
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
  local oldest = redis.call('ZRANGE', s.key, 0, 0, 'WITHSCORES')
  if #oldest > 0 then effective = math.max(tonumber(oldest[2]) + p[2] - now, 1) end
  return p[1], math.max(p[1] - s.total, 0), reset, effective
end
