-- GCRA (kind "gc"): p1 = burst, p2 = amount, p3 = period in microseconds. One value: the
-- theoretical arrival time, stored exactly as "whole:fraction" (TAT = whole + fraction /
-- amount microseconds), so an emission interval that is not a whole number of
-- microseconds never drifts. Mirrors src/algorithm/gcra.rs.

-- How far the TAT stored at `key` is ahead of now, scaled by the amount (p2): an exact
-- integer, 0 when it is not ahead. A value of another form (another client's, in our
-- keys) cannot be read: an error, never a fresh burst.
local function ahead_of(key, p2)
  local stored = call('GET', key)
  if stored then
    local whole, fraction = match(stored, '^(%d+):(%d+)$')
    whole, fraction = tonumber(whole), tonumber(fraction)
    if whole == nil or fraction == nil then
      error('tollgate: a GCRA key holds a value tollgate did not write')
    end
    if whole > now or (whole == now and fraction > 0) then
      return (whole - now) * p2 + fraction
    end
  end
  return 0
end

local function load(p, key)
  return { key = key, ahead = ahead_of(key, p[2]) }
end

-- Whether `cost` fits `ahead`: 'admit' (and how far ahead the debit leaves the TAT),
-- 'deny' (and the wait) or 'never'.
local function fits(p1, p2, p3, ahead)
  if cost > p1 then return 'never', 0 end
  local after = ahead + cost * p3
  local tolerance = p1 * p3
  if after <= tolerance then return 'admit', after end
  return 'deny', cdiv(after - tolerance, p2)
end

local function check(p, s)
  local verdict, value = fits(p[1], p[2], p[3], s.ahead)
  if verdict == 'admit' then return 'admit', 0 end
  return verdict, value
end

-- The TAT `ahead` (scaled by p2) of now, as "whole:fraction"; the key lives until the TAT
-- has passed (ceil of a ceil is one ceil; the millisecond added covers a product past
-- 2^53, rounded).
local function write(key, p2, ahead)
  local fraction = fmod(ahead, p2)
  call('SET', key, format('%d:%d', now + (ahead - fraction) / p2, fraction), 'PX',
    cdiv(ahead, p2 * 1000) + 1)
end

local function commit(p, s)
  s.ahead = s.ahead + cost * p[3]
  write(s.key, p[2], s.ahead)
end

-- Gives `units` back, less the intervals passed since `at`: the TAT moves back, never
-- before now.
local function refund(p, s, units, at, left)
  s.ahead = max(s.ahead - refund_level(p, units, at, p[1], left), 0)
  write(s.key, p[2], s.ahead)
end

-- The TAT ahead of now reads as a bucket's level: the tolerance is the bucket's full.
local function snapshot(p, s)
  return level_status(p, s.ahead)
end

-- One plain policy (main.lua's fast path, with the policy's arguments as sent): {outcome,
-- wait, how far ahead, now}.
local function one(key, p1, p2, p3)
  p1, p2, p3 = tonumber(p1), tonumber(p2), tonumber(p3)
  local ahead = ahead_of(key, p2)
  local verdict, value = fits(p1, p2, p3, ahead)
  if verdict == 'admit' then
    if cost > 0 then
      ahead = value
      write(key, p2, ahead)
    end
    return { 0, 0, ahead, now }
  elseif verdict == 'deny' then
    return { 1, value, ahead, now }
  end
  return { 2, 0, ahead, now }
end
