-- Sliding window counter (kind "sw"): p1 = limit, p2 = window, in microseconds.
-- estimate = ceil(previous * (window - elapsed) / window) + current, with the product taken
-- by muldiv (exact past 2^53). Mirrors src/algorithm/sliding_window.rs.

-- ceil(count * left / w), exact.
local function weighted(count, left, w)
  local q, r = muldiv(count, left, w)
  if r > 0 then q = q + 1 end
  return q
end

local function load(p, key)
  local w = p[2]
  local index = (now - math.fmod(now, w)) / w
  local stored = redis.call('HMGET', key, 'i', 'p', 'c')
  local s = { key = key, index = num(stored[1], 0), previous = num(stored[2], 0), current = num(stored[3], 0) }
  if index > s.index then
    if index == s.index + 1 then s.previous = s.current else s.previous = 0 end
    s.current = 0
    s.index = index
  end
  if index == s.index then s.elapsed = math.fmod(now, w) else s.elapsed = 0 end
  s.estimate = weighted(s.previous, w - s.elapsed, w) + s.current
  return s
end

-- How long until `units` more fit, with `current` counted in this window.
local function wait_for(p, s, current, units)
  local limit, w = p[1], p[2]
  local room = limit - units
  local retry
  if current <= room then
    local first = 0
    if s.previous > 0 then first = w - math.min(muldiv(room - current, w, s.previous), w) end
    retry = math.max(first - s.elapsed, 0)
  else
    retry = (w - s.elapsed) + w - math.min(muldiv(room, w, current), w)
  end
  return math.max(retry, 1)
end

local function check(p, s)
  local limit = p[1]
  if cost > limit then return 'never' end
  if s.estimate + cost <= limit then return 'admit', 0 end
  -- The smallest elapsed time at which the estimate leaves room for cost: in this window,
  -- or else in the next one, where this window's count becomes the previous.
  return 'deny', wait_for(p, s, s.current, cost)
end

local function commit(p, s)
  s.current = s.current + cost
  s.estimate = s.estimate + cost
  redis.call('HSET', s.key, 'i', s.index, 'p', s.previous, 'c', s.current)
  -- The current count matters until the end of the next window.
  redis.call('PEXPIRE', s.key, cdiv((p[2] - s.elapsed) + p[2], 1000) + 1)
end

local function snapshot(p, s)
  local w = p[2]
  local reset = 0
  if s.current > 0 then reset = (w - s.elapsed) + w elseif s.previous > 0 then reset = w - s.elapsed end
  local remaining = math.max(p[1] - s.estimate, 0)
  local effective = 0
  if s.estimate + remaining + 1 > p[1] then effective = wait_for(p, s, s.current + remaining, 1) end
  return p[1], remaining, reset, effective
end
