-- Token bucket and policing leaky bucket (kind "tb"): p1 = capacity, p2 = amount,
-- p3 = period in microseconds (the rate in lowest terms). The state is the level: tokens
-- missing from full times the period, and the time it was brought up to date. Refilling
-- `elapsed` adds exactly `elapsed * amount`. Mirrors src/algorithm/token_bucket.rs.

local load = load_bucket

-- Whether `cost` fits at `level`: 'admit' (no delay), 'deny' (and the wait) or 'never'.
local function fits(p1, p2, p3, level)
  if cost > p1 then return 'never', 0 end
  local needed = level + cost * p3
  local full = p1 * p3
  if needed <= full then return 'admit', 0 end
  return 'deny', cdiv(needed - full, p2)
end

local function check(p, s)
  return fits(p[1], p[2], p[3], s.level)
end

local commit = commit_bucket
local refund = refund_bucket

local function snapshot(p, s)
  return level_status(p, s.level)
end

-- One plain policy (main.lua's and one.lua's path, with the policy's arguments as sent):
-- the decision and the raw level.
one = bucket_one(fits)
