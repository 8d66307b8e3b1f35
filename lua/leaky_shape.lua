-- Shaping leaky bucket (kind "ls"): p1 = max delay, p2 = amount, p3 = period, in
-- microseconds. The level is what is queued ahead (units times the period); a request
-- waits for it to leak out, at most p1, or is denied. Mirrors src/algorithm/leaky_bucket.rs.

local function load(p, key)
  local stored = redis.call('HMGET', key, 'l', 't')
  local last = num(stored[2], now)
  local level = math.max(num(stored[1], 0) - math.max(now - last, 0) * p[2], 0)
  return { key = key, level = level, last = math.max(last, now) }
end

local function check(p, s)
  local threshold = p[1] * p[2]
  if s.level <= threshold then return 'admit', cdiv(s.level, p[2]) end
  return 'deny', cdiv(s.level - threshold, p[2])
end

local function commit(p, s)
  s.level = s.level + cost * p[3]
  redis.call('HSET', s.key, 'l', s.level, 't', s.last)
  redis.call('PEXPIRE', s.key, cdiv(cdiv(s.level, p[2]), 1000) + 1)
end

local function snapshot(p, s)
  local threshold = p[1] * p[2]
  local remaining = 0
  if s.level <= threshold then remaining = idiv(threshold - s.level, p[3]) + 1 end
  return idiv(threshold, p[3]) + 1, remaining, cdiv(s.level, p[2])
end
