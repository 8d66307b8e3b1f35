-- Shaping leaky bucket (kind "ls"): p1 = max delay, p2 = amount, p3 = period, in
-- microseconds. The level is what is queued ahead (units times the period); a request
-- waits for it to leak out, at most p1, or is denied. Mirrors src/algorithm/leaky_shape.rs.

local load = load_bucket

-- Whether `cost` fits at `level`: 'admit' (and how long to wait), 'deny' (and the wait
-- until it would fit) or 'never'.
local function fits(p1, p2, p3, level)
  local threshold = p1 * p2
  -- A cost larger than an empty bucket admits back to back never fits.
  if cost > idiv(threshold, p3) + 1 then return 'never', 0 end
  -- A request that costs nothing queues nothing: it goes at once.
  if cost == 0 then return 'admit', 0 end
  if level <= threshold then return 'admit', cdiv(level, p2) end
  return 'deny', cdiv(level - threshold, p2)
end

local function check(p, s)
  return fits(p[1], p[2], p[3], s.level)
end

local commit = commit_bucket
-- The burst it admits (its quota) is the shaping capacity, not p1 (the delay).
local function refund(p, s, units, at, left)
  s.level = max(s.level - refund_level(p, units, at, idiv(p[1] * p[2], p[3]) + 1, left), 0)
  store_bucket(p, s)
end

-- When the queue ends (the units queued last have leaked out), in microseconds: the end
-- of the newest booking while it is ahead (src/algorithm/leaky_shape.rs's `queue_end`).
queue_end = function(p, s)
  return s.last + cdiv(s.level, p[2])
end

local function snapshot(p, s)
  local threshold = p[1] * p[2]
  local remaining = 0
  if s.level <= threshold then remaining = idiv(threshold - s.level, p[3]) + 1 end
  -- Effective window: until one more unit could queue after `remaining` did.
  local effective = cdiv(s.level + remaining * p[3] - threshold, p[2])
  local capacity = idiv(threshold, p[3]) + 1
  local owed = 0
  -- Up to the capacity past the threshold owes nothing: a request of up to the capacity
  -- is admitted at the threshold, and puts it there.
  local queued = threshold + capacity * p[3]
  if s.level > queued then owed = cdiv(s.level - queued, p[3]) end
  -- What must leak out, beyond the unit back at the threshold, before a unit fits
  -- (what setting a number left gives back besides it; src/algorithm/leaky_shape.rs's
  -- `excess`).
  local excess = 0
  if s.level > threshold + p[3] then excess = cdiv(s.level - threshold - p[3], p[3]) end
  return capacity, remaining, cdiv(s.level, p[2]), effective, owed, excess
end

-- One plain policy (main.lua's and one.lua's path, with the policy's arguments as sent):
-- the decision and the raw level.
one = bucket_one(fits)
