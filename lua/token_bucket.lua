-- Token bucket and policing leaky bucket (kind "tb"): p1 = capacity, p2 = amount,
-- p3 = period in microseconds (the rate in lowest terms). The state is the level: tokens
-- missing from full times the period, and the time it was brought up to date. Refilling
-- `elapsed` adds exactly `elapsed * amount`. Mirrors src/algorithm/token_bucket.rs.

local load = load_bucket

local function check(p, s)
  if cost > p[1] then return 'never' end
  local needed = s.level + cost * p[3]
  local full = p[1] * p[3]
  if needed <= full then return 'admit', 0 end
  return 'deny', cdiv(needed - full, p[2])
end

local commit = commit_bucket
local refund = refund_bucket

local function snapshot(p, s)
  local spare = math.max(p[1] * p[3] - s.level, 0)
  -- Effective window: until the token being refilled now is whole.
  return p[1], idiv(spare, p[3]), cdiv(s.level, p[2]), cdiv(p[3] - math.fmod(spare, p[3]), p[2])
end
