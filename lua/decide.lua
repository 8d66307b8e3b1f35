-- tollgate: decide one request against every policy of one identity, atomically.
--
-- This script mirrors src/algorithm/ (the conformance suite checks that both give the
-- same decisions). It runs as one EVALSHA, so no other client sees or changes the state
-- between the check and the debit, and several policies are all-or-nothing: every policy
-- is checked first and debited only if all admit.
--
-- Time is Redis TIME in microseconds, never an application server's clock. Numbers are
-- integers kept below 2^53, where Lua's doubles are exact; every division goes through
-- idiv/cdiv, which are exact for such integers.
--
-- KEYS: two per policy, KEYS[2i-1] (state) and KEYS[2i] (the sliding log's counters; unused
--       by the other algorithms). Every key of one identity shares one hash tag, so one
--       Cluster slot.
-- ARGV: [1] now in microseconds, or "" to read TIME (only test builds pass a time)
--       [2] cost, [3] number of policies,
--       then per policy: kind, p1, p2, p3 (see the algorithms below).
-- Returns {outcome, policy, retry_after_us, delay_us, then per policy: limit, remaining,
--          reset_us}; outcome 0 = allowed, 1 = denied, 2 = the cost can never fit.

local now
if ARGV[1] ~= '' then
  now = tonumber(ARGV[1])
else
  local time = redis.call('TIME')
  now = tonumber(time[1]) * 1000000 + tonumber(time[2])
end
local cost = tonumber(ARGV[2])
local count = tonumber(ARGV[3])

-- floor(a / b) and ceil(a / b) for integers 0 <= a < 2^53, b > 0: fmod is exact, and so
-- is the division of an exact multiple.
local function idiv(a, b)
  return (a - math.fmod(a, b)) / b
end
local function cdiv(a, b)
  local r = math.fmod(a, b)
  local q = (a - r) / b
  if r > 0 then q = q + 1 end
  return q
end
local function num(value, default)
  if value == false or value == nil then return default end
  return tonumber(value)
end

-- Every algorithm is a table of four functions over a state table `s` (read by load):
--   check(s)  -> 'admit', delay | 'deny', retry_after | 'never'
--   commit(s) -> debits cost, then save(s) writes it back with a TTL
--   snapshot(s) -> limit, remaining, reset (microseconds until whole again)
local algorithms = {}

-- Fixed window: p1 = limit, p2 = window. Windows are aligned to the Unix epoch.
algorithms.fw = {
  load = function(p, key)
    local w = p[2]
    local index = (now - math.fmod(now, w)) / w
    local stored = redis.call('HMGET', key, 'i', 'c')
    local s = { key = key, index = index, count = 0 }
    local stored_index = num(stored[1], -1)
    -- Time that steps back never rolls a window back.
    if stored_index >= index then
      s.index = stored_index
      s.count = num(stored[2], 0)
    end
    s.finish = (s.index + 1) * w
    return s
  end,
  check = function(p, s)
    if cost > p[1] then return 'never' end
    if s.count + cost <= p[1] then return 'admit', 0 end
    return 'deny', s.finish - now
  end,
  commit = function(p, s)
    s.count = s.count + cost
    redis.call('HSET', s.key, 'i', s.index, 'c', s.count)
    redis.call('PEXPIRE', s.key, cdiv(s.finish - now, 1000) + 1)
  end,
  snapshot = function(p, s)
    return p[1], math.max(p[1] - s.count, 0), math.max(s.finish - now, 0)
  end,
}

-- Sliding window counter: p1 = limit, p2 = window.
-- estimate = ceil(previous * (window - elapsed) / window) + current
algorithms.sw = {
  load = function(p, key)
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
    s.estimate = cdiv(s.previous * (w - s.elapsed), w) + s.current
    return s
  end,
  check = function(p, s)
    local limit, w = p[1], p[2]
    if cost > limit then return 'never' end
    if s.estimate + cost <= limit then return 'admit', 0 end
    local room = limit - cost
    local function first_fit(weighted, fixed)
      if weighted == 0 then return 0 end
      return w - math.min(idiv((room - fixed) * w, weighted), w)
    end
    local retry
    if s.current <= room then
      retry = math.max(first_fit(s.previous, s.current) - s.elapsed, 0)
    else
      retry = (w - s.elapsed) + first_fit(s.current, 0)
    end
    return 'deny', math.max(retry, 1)
  end,
  commit = function(p, s)
    s.current = s.current + cost
    s.estimate = s.estimate + cost
    redis.call('HSET', s.key, 'i', s.index, 'p', s.previous, 'c', s.current)
    -- The current count matters until the end of the next window.
    local ttl = (p[2] - s.elapsed) + p[2]
    redis.call('PEXPIRE', s.key, cdiv(ttl, 1000) + 1)
  end,
  snapshot = function(p, s)
    local w = p[2]
    local reset = 0
    if s.current > 0 then reset = (w - s.elapsed) + w elseif s.previous > 0 then reset = w - s.elapsed end
    return p[1], math.max(p[1] - s.estimate, 0), reset
  end,
}

-- Sliding log: p1 = limit, p2 = window. KEYS[2i-1] is a sorted set of admitted requests
-- (score: time; member: "sequence:units", unique even within one microsecond), KEYS[2i]
-- a hash with the units in the log (t) and the sequence (s).
algorithms.sl = {
  load = function(p, key, aux)
    local s = { key = key, aux = aux, total = num(redis.call('HGET', aux, 't'), 0) }
    local horizon = now - p[2]
    local expired = redis.call('ZRANGEBYSCORE', key, '-inf', horizon)
    if #expired > 0 then
      for _, member in ipairs(expired) do
        s.total = s.total - tonumber(string.match(member, ':(%d+)$'))
      end
      redis.call('ZREMRANGEBYSCORE', key, '-inf', horizon)
      if s.total < 0 then s.total = 0 end
      redis.call('HSET', aux, 't', s.total)
    end
    return s
  end,
  check = function(p, s)
    local limit, w = p[1], p[2]
    if cost > limit then return 'never' end
    if s.total + cost <= limit then return 'admit', 0 end
    -- Wait until enough of the oldest entries have left the window.
    local needed = s.total + cost - limit
    local freed = 0
    local entries = redis.call('ZRANGE', s.key, 0, -1, 'WITHSCORES')
    for i = 1, #entries, 2 do
      freed = freed + tonumber(string.match(entries[i], ':(%d+)$'))
      if freed >= needed then
        return 'deny', tonumber(entries[i + 1]) + w - now
      end
    end
    return 'deny', w
  end,
  commit = function(p, s)
    if cost == 0 then return end
    local sequence = redis.call('HINCRBY', s.aux, 's', 1)
    redis.call('ZADD', s.key, now, sequence .. ':' .. cost)
    s.total = s.total + cost
    s.newest = now
    redis.call('HSET', s.aux, 't', s.total)
    local ttl = cdiv(p[2], 1000) + 1
    redis.call('PEXPIRE', s.key, ttl)
    redis.call('PEXPIRE', s.aux, ttl)
  end,
  snapshot = function(p, s)
    local newest = s.newest
    if newest == nil then
      local last = redis.call('ZRANGE', s.key, -1, -1, 'WITHSCORES')
      if #last > 0 then newest = tonumber(last[2]) end
    end
    local reset = 0
    if newest ~= nil then reset = math.max(newest + p[2] - now, 0) end
    return p[1], math.max(p[1] - s.total, 0), reset
  end,
}

-- Buckets keep the level (units missing from full, or queued, times the period) and the
-- time it was last brought up to date: p2 units leak or refill every p3 microseconds.
local function load_bucket(p, key)
  local stored = redis.call('HMGET', key, 'l', 't')
  local s = { key = key, level = num(stored[1], 0), last = num(stored[2], now) }
  local elapsed = math.max(now - s.last, 0)
  s.level = math.max(s.level - elapsed * p[2], 0)
  s.last = math.max(s.last, now)
  return s
end
local function commit_bucket(p, s)
  s.level = s.level + cost * p[3]
  redis.call('HSET', s.key, 'l', s.level, 't', s.last)
  redis.call('PEXPIRE', s.key, cdiv(cdiv(s.level, p[2]), 1000) + 1)
end

-- Token bucket and policing leaky bucket: p1 = capacity, p2 = amount, p3 = period.
algorithms.tb = {
  load = load_bucket,
  check = function(p, s)
    if cost > p[1] then return 'never' end
    local needed = s.level + cost * p[3]
    local full = p[1] * p[3]
    if needed <= full then return 'admit', 0 end
    return 'deny', cdiv(needed - full, p[2])
  end,
  commit = commit_bucket,
  snapshot = function(p, s)
    return p[1], idiv(math.max(p[1] * p[3] - s.level, 0), p[3]), cdiv(s.level, p[2])
  end,
}

-- Shaping leaky bucket: p1 = max delay, p2 = amount, p3 = period. A request waits for
-- the units ahead of it to leak out, at most p1.
algorithms.ls = {
  load = load_bucket,
  check = function(p, s)
    local threshold = p[1] * p[2]
    if s.level <= threshold then return 'admit', cdiv(s.level, p[2]) end
    return 'deny', cdiv(s.level - threshold, p[2])
  end,
  commit = commit_bucket,
  snapshot = function(p, s)
    local threshold = p[1] * p[2]
    local limit = idiv(threshold, p[3]) + 1
    local remaining = 0
    if s.level <= threshold then remaining = idiv(threshold - s.level, p[3]) + 1 end
    return limit, remaining, cdiv(s.level, p[2])
  end,
}

-- GCRA: p1 = burst, p2 = amount, p3 = period. One value: the theoretical arrival time,
-- stored exactly as "whole:fraction", TAT = whole + fraction / amount microseconds, so an
-- emission interval that is not a whole number of microseconds never drifts.
algorithms.gc = {
  load = function(p, key)
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
  end,
  check = function(p, s)
    if cost > p[1] then return 'never' end
    local ahead = s.ahead + cost * p[3]
    local tolerance = p[1] * p[3]
    if ahead <= tolerance then return 'admit', 0 end
    return 'deny', cdiv(ahead - tolerance, p[2])
  end,
  commit = function(p, s)
    s.ahead = s.ahead + cost * p[3]
    local whole = now + idiv(s.ahead, p[2])
    local fraction = math.fmod(s.ahead, p[2])
    redis.call('SET', s.key, string.format('%d:%d', whole, fraction), 'PX', cdiv(cdiv(s.ahead, p[2]), 1000) + 1)
  end,
  snapshot = function(p, s)
    return p[1], idiv(math.max(p[1] * p[3] - s.ahead, 0), p[3]), cdiv(s.ahead, p[2])
  end,
}

local policies = {}
local outcome, denying, longest, delay = 0, 0, 0, 0
for i = 1, count do
  local base = 3 + (i - 1) * 4
  local kind = ARGV[base + 1]
  local p = { tonumber(ARGV[base + 2]), tonumber(ARGV[base + 3]), tonumber(ARGV[base + 4]) }
  local algorithm = algorithms[kind]
  if algorithm == nil then
    return redis.error_reply('tollgate: unknown algorithm ' .. tostring(kind))
  end
  local s = algorithm.load(p, KEYS[2 * i - 1], KEYS[2 * i])
  local verdict, value = algorithm.check(p, s)
  if verdict == 'never' then
    if outcome ~= 2 then outcome, denying = 2, i end
  elseif verdict == 'deny' then
    if outcome == 0 or (outcome == 1 and value > longest) then
      outcome, denying, longest = 1, i, value
    end
  elseif value > delay then
    delay = value
  end
  policies[i] = { algorithm = algorithm, p = p, s = s }
end

if outcome == 0 and cost > 0 then
  for i = 1, count do
    local policy = policies[i]
    policy.algorithm.commit(policy.p, policy.s)
  end
end

local reply = { outcome, denying, longest, delay }
for i = 1, count do
  local policy = policies[i]
  local limit, remaining, reset = policy.algorithm.snapshot(policy.p, policy.s)
  reply[#reply + 1] = limit
  reply[#reply + 1] = remaining
  reply[#reply + 1] = reset
end
return reply
