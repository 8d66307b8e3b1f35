-- In-flight limit (kind "cc"): p1 = limit, p2 = lease in microseconds, p3 = this
-- request's lease id. The state key is a sorted set of the slots taken (member: the lease
-- id; score: when the slot expires by itself, so that a replica that dies holding slots
-- cannot keep them). A request of cost 0 takes no slot. Mirrors src/algorithm/in_flight.rs
-- (which needs no lease: in one process every slot is given back).

local function load(p, key)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  return { key = key, count = redis.call('ZCARD', key) }
end

local function check(p, s)
  if s.count + math.min(cost, 1) <= p[1] then return 'admit', 0 end
  -- A slot frees when some request ends: nothing here can say when.
  return 'deny', 1000000
end

local function commit(p, s)
  if cost == 0 then return end
  redis.call('ZADD', s.key, now + p[2], string.format('%d', p[3]))
  s.count = s.count + 1
  -- Every slot expires within one lease from now: so does the key.
  redis.call('PEXPIRE', s.key, cdiv(p[2], 1000) + 1)
end

local function refund(p, s, units, at)
  s.count = s.count - redis.call('ZREM', s.key, string.format('%d', p[3]))
end

local function snapshot(p, s)
  return p[1], math.max(p[1] - s.count, 0), 0, 0
end
