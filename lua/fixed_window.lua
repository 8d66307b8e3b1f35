-- Fixed window (kind "fw"): p1 = limit, p2 = window, in microseconds. Windows are aligned
-- to the Unix epoch (as in every store). No number here is a product of the limit and the
-- window. Mirrors src/algorithm/fixed_window.rs.

-- The window counted at `key` (of p2 µs): its index, its count, when it ends, and whether
-- the key already holds this very window (then it expires when the window ends, and a
-- write changes only the count). Time that steps back never rolls a window back.
local function window_of(key, w)
  local index = (now - fmod(now, w)) / w
  local stored = call('HMGET', key, 'i', 'c')
  local count = 0
  local stored_index = tonumber(stored[1] or -1)
  if stored_index == nil then
    error('tollgate: a fixed window holds an index tollgate did not write')
  end
  local kept = stored_index == index
  if stored_index >= index then
    index, count = stored_index, tonumber(stored[2] or 0)
    if count == nil then
      error('tollgate: a fixed window holds a count tollgate did not write')
    end
  end
  return index, count, (index + 1) * w, kept
end

local function load(p, key)
  local index, count, finish, kept = window_of(key, p[2])
  return { key = key, index = index, count = count, finish = finish, kept = kept }
end

-- Whether `cost` fits `count` of a limit of p1: 'admit', 'deny' (and the wait until the
-- window ends) or 'never'.
local function fits(p1, count, finish)
  if cost > p1 then return 'never', 0 end
  if count + cost <= p1 then return 'admit', 0 end
  return 'deny', finish - now
end

local function check(p, s)
  return fits(p[1], s.count, s.finish)
end

-- A key outlives its window by a window, up to a second (ms): writes within the window
-- leave its expiry alone, so the expiry has to hold even where a node's clock runs behind
-- the one that set it (a slot migrated, a replica promoted). Living longer is harmless:
-- the stored index tells an old window from the current one.
local function grace(w)
  return min(cdiv(w, 1000), 1000)
end

-- Writes the count; a window new to the key also its index and its expiry (a key that held
-- this window since its first write expires after it already).
local function write(key, index, count, finish, kept, w)
  if kept then
    call('HSET', key, 'c', count)
    return
  end
  call('HSET', key, 'i', index, 'c', count)
  call('PEXPIRE', key, cdiv(finish - now, 1000) + grace(w))
end

local function commit(p, s)
  s.count = s.count + cost
  write(s.key, s.index, s.count, s.finish, s.kept, p[2])
end

-- Gives back `units` debited at `at`, if that was in the window counted now (at -1: any).
local function refund(p, s, units, at)
  if at >= 0 and (at - fmod(at, p[2])) / p[2] ~= s.index then return end
  s.count = max(s.count - units, 0)
  write(s.key, s.index, s.count, s.finish, s.kept, p[2])
end

local function snapshot(p, s)
  local reset = max(s.finish - now, 0)
  return p[1], max(p[1] - s.count, 0), reset, reset, max(s.count - p[1], 0)
end

-- One plain policy (main.lua's fast path, with the policy's arguments as sent): {outcome,
-- wait, count, end of the window, now}.
local function one(key, p1, p2)
  p1, p2 = tonumber(p1), tonumber(p2)
  local index, count, finish, kept = window_of(key, p2)
  local verdict, value = fits(p1, count, finish)
  if verdict == 'admit' then
    if cost > 0 then
      count = count + cost
      write(key, index, count, finish, kept, p2)
    end
    return { 0, 0, count, finish, now }
  elseif verdict == 'deny' then
    return { 1, value, count, finish, now }
  end
  return { 2, 0, count, finish, now }
end
