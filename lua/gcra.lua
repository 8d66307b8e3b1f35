-- GCRA (kind "gc"): p1 = burst, p2 = amount, p3 = period in microseconds. One value: the
-- theoretical arrival time, stored exactly as "whole:fraction" (TAT = whole + fraction /
-- amount microseconds), so an emission interval that is not a whole number of
-- microseconds never drifts. Mirrors src/algorithm/gcra.rs.

local function load(p, key)
  local s = { key = key, whole = now, fraction = 0 }
  local stored = redis.call('GET', key)
  if stored then
    local whole, fraction = string.match(stored, '^(%d+):(%d+)$')
    whole, fraction = tonumber(whole), tonumber(fraction)
    if whole ~= nil and (whole > now or (whole == now and fraction > 0)) then
      s.whole, s.fraction = whole, fraction
    end
  end
  -- How far the TAT is ahead of now, scaled by the amount: an exact integer.
  s.ahead = (s.whole - now) * p[2] + s.fraction
  return s
end

local function check(p, s)
  if cost > p[1] then return 'never' end
  local ahead = s.ahead + cost * p[3]
  local tolerance = p[1] * p[3]
  if ahead <= tolerance then return 'admit', 0 end
  return 'deny', cdiv(ahead - tolerance, p[2])
end

local function store(p, s)
  local whole = now + idiv(s.ahead, p[2])
  local fraction = math.fmod(s.ahead, p[2])
  redis.call('SET', s.key, string.format('%d:%d', whole, fraction), 'PX', cdiv(cdiv(s.ahead, p[2]), 1000) + 1)
end

local function commit(p, s)
  s.ahead = s.ahead + cost * p[3]
  store(p, s)
end

-- Gives `units` back, less the intervals passed since `at`: the TAT moves back, never
-- before now.
local function refund(p, s, units, at, left)
  s.ahead = math.max(s.ahead - refund_level(p, units, at, p[1], left), 0)
  store(p, s)
end

local function snapshot(p, s)
  local spare = math.max(p[1] * p[3] - s.ahead, 0)
  -- Effective window: until the next emission interval has passed.
  return p[1], idiv(spare, p[3]), cdiv(s.ahead, p[2]), cdiv(p[3] - math.fmod(spare, p[3]), p[2])
end
