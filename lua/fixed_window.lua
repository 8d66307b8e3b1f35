-- Fixed window (kind "fw"): p1 = limit, p2 = window, in microseconds. Windows are aligned
-- to the Unix epoch (as in every store). No number here is a product of the limit and the
-- window. Mirrors src/algorithm/fixed_window.rs.

local function load(p, key)
  local w = p[2]
  local index = (now - math.fmod(now, w)) / w
  local stored = redis.call('HMGET', key, 'i', 'c')
  local s = { key = key, index = index, count = 0 }
  local stored_index = num(stored[1], -1)
  -- Time that steps back never rolls a window back.
  if stored_index >= index then
    s.index = stored_index
    s.count = num(stored[2], 0)
  end
  s.finish = (s.index + 1) * w
  return s
end

local function check(p, s)
  if cost > p[1] then return 'never' end
  if s.count + cost <= p[1] then return 'admit', 0 end
  return 'deny', s.finish - now
end

local function store(s)
  redis.call('HSET', s.key, 'i', s.index, 'c', s.count)
  redis.call('PEXPIRE', s.key, cdiv(s.finish - now, 1000) + 1)
end

local function commit(p, s)
  s.count = s.count + cost
  store(s)
end

-- Gives back `units` debited at `at`, if that was in the window counted now (at -1: any).
local function refund(p, s, units, at)
  if at >= 0 and (at - math.fmod(at, p[2])) / p[2] ~= s.index then return end
  s.count = math.max(s.count - units, 0)
  store(s)
end

local function snapshot(p, s)
  local reset = math.max(s.finish - now, 0)
  return p[1], math.max(p[1] - s.count, 0), reset, reset
end
