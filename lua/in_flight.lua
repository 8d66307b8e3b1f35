-- In-flight limit (kind "cc"): p1 = limit, p2 = lease in microseconds, p3 = this
-- request's lease id. The state key is a sorted set of the slots taken (member: the lease
-- id; score: when the slot expires by itself, so that a replica that dies holding slots
-- cannot keep them). A request of cost 0 takes no slot. Mirrors src/algorithm/in_flight.rs
-- (which needs no lease: in one process every slot is given back).

-- The slots taken at `key`, once the expired ones are gone.
local function taken(key)
  call('ZREMRANGEBYSCORE', key, '-inf', format('%d', now))
  return call('ZCARD', key)
end

local function load(p, key)
  return { key = key, count = taken(key) }
end

-- Whether a slot is free: 'admit' or 'deny' (and a wait: a slot frees when some request
-- ends, and nothing here can say when).
local function fits(p1, count)
  if count + min(cost, 1) <= p1 then return 'admit', 0 end
  return 'deny', 1000000
end

local function check(p, s)
  return fits(p[1], s.count)
end

-- Takes the slot `member` (the lease id, spelled as `%d` spells it) for a lease of p2.
local function take(key, p2, member)
  call('ZADD', key, format('%d', now + p2), member)
  -- The key lives as long as its longest-leased slot: slots taken under another lease
  -- (the policy's lease changed) share it, and a shorter one must not cut theirs.
  extend_ttl(key, cdiv(p2, 1000) + 1)
end

local function commit(p, s)
  if cost == 0 then return end
  take(s.key, p[2], format('%d', p[3]))
  s.count = s.count + 1
end

local function refund(p, s, units, at)
  s.count = s.count - call('ZREM', s.key, format('%d', p[3]))
end

local function snapshot(p, s)
  return p[1], max(p[1] - s.count, 0), 0, 0, 0
end

-- One plain policy (main.lua's fast path, with the policy's arguments as sent): {outcome,
-- wait, slots taken, now}. The lease id arrives in decimal digits, as `%d` writes it.
local function one(key, p1, p2, id)
  local count = taken(key)
  local verdict, value = fits(tonumber(p1), count)
  if verdict == 'admit' then
    if cost > 0 then
      take(key, tonumber(p2), id)
      count = count + 1
    end
    return { 0, 0, count, now }
  end
  return { 1, value, count, now }
end
