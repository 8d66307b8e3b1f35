-- Sliding window counter (kind "sw"): p1 = limit, p2 = window in microseconds, p3 = the
-- number of sub-windows k (0 is read as 1). The hash holds 'i' (the current sub-window's
-- index) and the k + 1 newest sub-window counts, oldest first: 'p', 'c' for k = 1, else
-- 'c0' .. 'ck'. The estimate counts the k newer sub-windows whole and the oldest by the
-- share of it still inside the window (ceil, through the exact muldiv), never forgiving
-- more than floor(limit / k) of it. Mirrors src/algorithm/sliding_window.rs.

local ONE = { 'p', 'c' }

local function names_for(k)
  if k == 1 then return ONE end
  local names = {}
  for m = 0, k do names[m + 1] = 'c' .. m end
  return names
end

-- The units of the oldest sub-window still counted, `left` microseconds before it leaves.
local function counted(s, oldest, left)
  local q, r = muldiv(oldest, left, s.span)
  if r > 0 then q = q + 1 end
  return max(q, oldest - s.forgiven)
end

local function load(p, key)
  local k = max(p[3], 1)
  local span = p[2] / k -- exact: the policy was validated to split into whole microseconds
  local index = (now - fmod(now, span)) / span
  local names = names_for(k)
  local stored = call('HMGET', key, 'i', unpack(names))
  local s = {
    key = key, k = k, span = span, names = names, counts = {},
    forgiven = (p[1] - fmod(p[1], k)) / k,
    index = tonumber(stored[1] or 0),
  }
  for m = 1, k + 1 do s.counts[m] = tonumber(stored[m + 1] or 0) end
  if index > s.index then
    local shift = index - s.index
    for m = 1, k + 1 do
      if m + shift <= k + 1 then s.counts[m] = s.counts[m + shift] else s.counts[m] = 0 end
    end
    s.index = index
  end
  if index == s.index then s.elapsed = fmod(now, span) else s.elapsed = 0 end
  -- Time that stepped back before the stored sub-window: waits count from its start.
  s.behind = max(s.index * span - now, 0)
  local estimate = counted(s, s.counts[1], span - s.elapsed)
  for m = 2, k + 1 do estimate = estimate + s.counts[m] end
  s.estimate = estimate
  return s
end

-- Microseconds until `units` more fit, with `extra` units spent in the current sub-window
-- first: the sub-window `step` from now has position `step` as its oldest.
local function wait_for(p, s, units, extra)
  local room = p[1] - units
  local last = s.k + 1
  local newer_sum = 0
  for m = 2, last do newer_sum = newer_sum + s.counts[m] end
  for step = 1, last do
    if step > 1 then newer_sum = newer_sum - s.counts[step] end
    local oldest, newer = s.counts[step], newer_sum + extra
    if step == last then oldest, newer = oldest + extra, 0 end
    if newer <= room and oldest - s.forgiven <= room - newer then
      local first = 0
      if oldest > 0 then first = s.span - min(muldiv(room - newer, s.span, oldest), s.span) end
      local at = first
      if step == 1 then at = max(at, s.elapsed) end
      if at < s.span then return max((step - 1) * s.span + at - s.elapsed + s.behind, 1) end
    end
  end
  return max(last * s.span - s.elapsed + s.behind, 1)
end

local function check(p, s)
  local limit = p[1]
  if cost > limit then return 'never' end
  if s.estimate + cost <= limit then return 'admit', 0 end
  return 'deny', wait_for(p, s, cost, 0)
end

local function store(s)
  local last = s.k + 1
  local fields = { 'i', s.index }
  for m = 1, last do
    fields[#fields + 1] = s.names[m]
    fields[#fields + 1] = s.counts[m]
  end
  call('HSET', s.key, unpack(fields))
  -- The current count matters until it is a whole window old.
  call('PEXPIRE', s.key, cdiv(last * s.span - s.elapsed + s.behind, 1000) + 1)
end

local function commit(p, s)
  local last = s.k + 1
  s.counts[last] = s.counts[last] + cost
  s.estimate = s.estimate + cost
  store(s)
end

-- Gives back `units` debited at `at` from the sub-window they were counted in, while it
-- is still counted; at -1: `units` off the estimate, from the newest sub-windows first,
-- then as much of the oldest as lowers its counted share by what is left to give.
local function refund(p, s, units, at)
  if at < 0 then
    for m = s.k + 1, 2, -1 do
      local taken = min(units, s.counts[m])
      s.counts[m] = s.counts[m] - taken
      units = units - taken
    end
    local oldest = s.counts[1]
    if units > 0 and oldest > 0 then
      local to_go = s.span - s.elapsed
      local target = max(counted(s, oldest, to_go) - units, 0)
      local by_share = muldiv(target, s.span, to_go)
      -- No less than gives back `units` once what is never forgiven is all that counts
      -- of it: less now, never more later in the sub-window.
      local floor = 0
      if oldest - s.forgiven > units then floor = oldest - units end
      s.counts[1] = max(min(oldest, target + s.forgiven, by_share), floor)
    end
  else
    local age = s.index - (at - fmod(at, s.span)) / s.span
    if age < 0 or age > s.k then return end
    local m = s.k + 1 - age
    s.counts[m] = max(s.counts[m] - units, 0)
  end
  local estimate = counted(s, s.counts[1], s.span - s.elapsed)
  for j = 2, s.k + 1 do estimate = estimate + s.counts[j] end
  s.estimate = estimate
  store(s)
end

local function snapshot(p, s)
  local reset = 0
  for m = s.k + 1, 1, -1 do
    if s.counts[m] > 0 then
      reset = m * s.span - s.elapsed + s.behind
      break
    end
  end
  local remaining = max(p[1] - s.estimate, 0)
  local effective = 0
  if s.estimate + remaining + 1 > p[1] then effective = wait_for(p, s, 1, remaining) end
  return p[1], remaining, reset, effective, max(s.estimate - p[1], 0)
end

-- One plain policy of one sub-window (main.lua's fast path, with the policy's arguments as
-- sent; nil for several sub-windows, which take the tables' path): {outcome, wait, the
-- stored window's index, the previous and the current count, now}. The same steps as
-- load, check and commit above for k = 1, where nothing of the oldest count is forgiven
-- beyond the limit.
local function one(key, p1, p2, p3)
  if p3 ~= '0' then return nil end
  p1, p2 = tonumber(p1), tonumber(p2)
  local index = (now - fmod(now, p2)) / p2
  local stored = call('HMGET', key, 'i', 'p', 'c')
  local at = tonumber(stored[1] or 0)
  local previous, current = tonumber(stored[2] or 0), tonumber(stored[3] or 0)
  if index > at then
    if index - at == 1 then previous = current else previous = 0 end
    current, at = 0, index
  end
  local elapsed = 0
  if index == at then elapsed = fmod(now, p2) end
  local behind = max(at * p2 - now, 0)
  local q, r = muldiv(previous, p2 - elapsed, p2)
  if r > 0 then q = q + 1 end
  local estimate = max(q, previous - p1) + current
  if cost > p1 then return { 2, 0, at, previous, current, now } end
  if estimate + cost <= p1 then
    if cost > 0 then
      current = current + cost
      call('HSET', key, 'i', at, 'p', previous, 'c', current)
      call('PEXPIRE', key, cdiv(2 * p2 - elapsed + behind, 1000) + 1)
    end
    return { 0, 0, at, previous, current, now }
  end
  -- Denied (rarer): the wait, through the tables' path.
  local s = {
    k = 1, span = p2, counts = { previous, current }, forgiven = p1,
    elapsed = elapsed, behind = behind,
  }
  return { 1, wait_for({ p1, p2, 0 }, s, cost, 0), at, previous, current, now }
end
