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

-- Each algorithm has four steps, dispatched on its kind below (plain functions rather
-- than a table of closures per algorithm: the script body runs on every call, and
-- building those closures cost more than the decision itself):
--   load(kind, p, key, aux) -> state s, brought up to now without changing its meaning
--   check(kind, p, s)       -> 'admit', delay | 'deny', retry_after | 'never'
--   commit(kind, p, s)      -> debits cost and writes the state back with a TTL
--   snapshot(kind, p, s)    -> limit, remaining, reset (microseconds until whole again)
--
-- fw  fixed window            p1 = limit,     p2 = window
-- sw  sliding window counter  p1 = limit,     p2 = window
-- sl  sliding log             p1 = limit,     p2 = window
-- tb  token bucket, police    p1 = capacity,  p2 = amount, p3 = period
-- ls  leaky bucket, shape     p1 = max delay, p2 = amount, p3 = period
-- gc  GCRA                    p1 = burst,     p2 = amount, p3 = period

local function load(kind, p, key, aux)
  if kind == 'tb' or kind == 'ls' then
    -- Buckets keep the level (units missing from full, or queued, times the period) and
    -- the time it was last brought up to date; p2 units leak or refill every p3.
    local stored = redis.call('HMGET', key, 'l', 't')
    local last = num(stored[2], now)
    local level = math.max(num(stored[1], 0) - math.max(now - last, 0) * p[2], 0)
    return { key = key, level = level, last = math.max(last, now) }
  elseif kind == 'gc' then
    -- GCRA keeps one value, the theoretical arrival time, stored exactly as
    -- "whole:fraction" (TAT = whole + fraction / amount microseconds), so an emission
    -- interval that is not a whole number of microseconds never drifts.
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
  elseif kind == 'fw' then
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
  elseif kind == 'sw' then
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
    -- estimate = ceil(previous * (window - elapsed) / window) + current
    s.estimate = cdiv(s.previous * (w - s.elapsed), w) + s.current
    return s
  elseif kind == 'sl' then
    -- A sorted set of admitted requests (score: time; member: "sequence:units", unique
    -- even within one microsecond) and a hash with the units in it (t) and the sequence (s).
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
  end
  return nil
end

local function check(kind, p, s)
  if kind == 'ls' then
    local threshold = p[1] * p[2]
    if s.level <= threshold then return 'admit', cdiv(s.level, p[2]) end
    return 'deny', cdiv(s.level - threshold, p[2])
  end
  if cost > p[1] then return 'never' end
  if kind == 'tb' then
    local needed = s.level + cost * p[3]
    local full = p[1] * p[3]
    if needed <= full then return 'admit', 0 end
    return 'deny', cdiv(needed - full, p[2])
  elseif kind == 'gc' then
    local ahead = s.ahead + cost * p[3]
    local tolerance = p[1] * p[3]
    if ahead <= tolerance then return 'admit', 0 end
    return 'deny', cdiv(ahead - tolerance, p[2])
  elseif kind == 'fw' then
    if s.count + cost <= p[1] then return 'admit', 0 end
    return 'deny', s.finish - now
  elseif kind == 'sw' then
    local limit, w = p[1], p[2]
    if s.estimate + cost <= limit then return 'admit', 0 end
    -- The smallest elapsed time at which the estimate leaves room for cost, in this
    -- window, or else in the next one (where this window's count becomes the previous).
    local room = limit - cost
    local retry
    if s.current <= room then
      local first = 0
      if s.previous > 0 then first = w - math.min(idiv((room - s.current) * w, s.previous), w) end
      retry = math.max(first - s.elapsed, 0)
    else
      retry = (w - s.elapsed) + w - math.min(idiv(room * w, s.current), w)
    end
    return 'deny', math.max(retry, 1)
  else -- sl
    if s.total + cost <= p[1] then return 'admit', 0 end
    -- Wait until enough of the oldest entries have left the window.
    local needed = s.total + cost - p[1]
    local freed = 0
    local entries = redis.call('ZRANGE', s.key, 0, -1, 'WITHSCORES')
    for i = 1, #entries, 2 do
      freed = freed + tonumber(string.match(entries[i], ':(%d+)$'))
      if freed >= needed then
        return 'deny', tonumber(entries[i + 1]) + p[2] - now
      end
    end
    return 'deny', p[2]
  end
end

local function commit(kind, p, s)
  if kind == 'tb' or kind == 'ls' then
    s.level = s.level + cost * p[3]
    redis.call('HSET', s.key, 'l', s.level, 't', s.last)
    redis.call('PEXPIRE', s.key, cdiv(cdiv(s.level, p[2]), 1000) + 1)
  elseif kind == 'gc' then
    s.ahead = s.ahead + cost * p[3]
    local whole = now + idiv(s.ahead, p[2])
    local fraction = math.fmod(s.ahead, p[2])
    redis.call('SET', s.key, string.format('%d:%d', whole, fraction), 'PX', cdiv(cdiv(s.ahead, p[2]), 1000) + 1)
  elseif kind == 'fw' then
    s.count = s.count + cost
    redis.call('HSET', s.key, 'i', s.index, 'c', s.count)
    redis.call('PEXPIRE', s.key, cdiv(s.finish - now, 1000) + 1)
  elseif kind == 'sw' then
    s.current = s.current + cost
    s.estimate = s.estimate + cost
    redis.call('HSET', s.key, 'i', s.index, 'p', s.previous, 'c', s.current)
    -- The current count matters until the end of the next window.
    redis.call('PEXPIRE', s.key, cdiv((p[2] - s.elapsed) + p[2], 1000) + 1)
  else -- sl
    local sequence = redis.call('HINCRBY', s.aux, 's', 1)
    redis.call('ZADD', s.key, now, sequence .. ':' .. cost)
    s.total = s.total + cost
    s.newest = now
    redis.call('HSET', s.aux, 't', s.total)
    local ttl = cdiv(p[2], 1000) + 1
    redis.call('PEXPIRE', s.key, ttl)
    redis.call('PEXPIRE', s.aux, ttl)
  end
end

local function snapshot(kind, p, s)
  if kind == 'tb' then
    return p[1], idiv(math.max(p[1] * p[3] - s.level, 0), p[3]), cdiv(s.level, p[2])
  elseif kind == 'ls' then
    local threshold = p[1] * p[2]
    local remaining = 0
    if s.level <= threshold then remaining = idiv(threshold - s.level, p[3]) + 1 end
    return idiv(threshold, p[3]) + 1, remaining, cdiv(s.level, p[2])
  elseif kind == 'gc' then
    return p[1], idiv(math.max(p[1] * p[3] - s.ahead, 0), p[3]), cdiv(s.ahead, p[2])
  elseif kind == 'fw' then
    return p[1], math.max(p[1] - s.count, 0), math.max(s.finish - now, 0)
  elseif kind == 'sw' then
    local w = p[2]
    local reset = 0
    if s.current > 0 then reset = (w - s.elapsed) + w elseif s.previous > 0 then reset = w - s.elapsed end
    return p[1], math.max(p[1] - s.estimate, 0), reset
  else -- sl
    local newest = s.newest
    if newest == nil then
      local last = redis.call('ZRANGE', s.key, -1, -1, 'WITHSCORES')
      if #last > 0 then newest = tonumber(last[2]) end
    end
    local reset = 0
    if newest ~= nil then reset = math.max(newest + p[2] - now, 0) end
    return p[1], math.max(p[1] - s.total, 0), reset
  end
end

local policies = {}
local outcome, denying, longest, delay = 0, 0, 0, 0
for i = 1, count do
  local base = 3 + (i - 1) * 4
  local kind = ARGV[base + 1]
  local p = { tonumber(ARGV[base + 2]), tonumber(ARGV[base + 3]), tonumber(ARGV[base + 4]) }
  local s = load(kind, p, KEYS[2 * i - 1], KEYS[2 * i])
  if s == nil then
    return redis.error_reply('tollgate: unknown algorithm ' .. tostring(kind))
  end
  local verdict, value = check(kind, p, s)
  if verdict == 'never' then
    if outcome ~= 2 then outcome, denying = 2, i end
  elseif verdict == 'deny' then
    if outcome == 0 or (outcome == 1 and value > longest) then
      outcome, denying, longest = 1, i, value
    end
  elseif value > delay then
    delay = value
  end
  policies[i] = { kind = kind, p = p, s = s }
end

if outcome == 0 and cost > 0 then
  for i = 1, count do
    local policy = policies[i]
    commit(policy.kind, policy.p, policy.s)
  end
end

local reply = { outcome, denying, longest, delay }
for i = 1, count do
  local policy = policies[i]
  local limit, remaining, reset = snapshot(policy.kind, policy.p, policy.s)
  reply[#reply + 1] = limit
  reply[#reply + 1] = remaining
  reply[#reply + 1] = reset
end
return reply
