-- Token bucket and policing leaky bucket (kind "tb"): p1 = capacity, p2 = amount,
-- p3 = period in microseconds (the rate in lowest terms). The state is the level: tokens
-- missing from full times the period, and the time it was brought up to date. Refilling
-- `elapsed` adds exactly `elapsed * amount`. Mirrors src/algorithm/token_bucket.rs.

local function load(p, key)
  local stored = redis.call('HMGET', key, 'l', 't')
  local last = num(stored[2], now)
  local level = math.max(num(stored[1], 0) - math.max(now - last, 0) * p[2], 0)
  return { key = key, level = level, last = math.max(last, now) }
end

local function check(p, s)
  if cost > p[1] then return 'never' end
  local needed = s.level + cost * p[3]
  local full = p[1] * p[3]
  if needed <= full then return 'admit', 0 end
  return 'deny', cdiv(needed - full, p[2])
end

local function commit(p, s)
  s.level = s.level + cost * p[3]
  redis.call('HSET', s.key, 'l', s.level, 't', s.last)
  redis.call('PEXPIRE', s.key, cdiv(cdiv(s.level, p[2]), 1000) + 1)
end

local function snapshot(p, s)
  return p[1], idiv(math.max(p[1] * p[3] - s.level, 0), p[3]), cdiv(s.level, p[2])
end
