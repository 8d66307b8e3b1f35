-- tollgate: the prelude of every decision script.
--
-- src/store/redis.rs assembles the scripts from the files in lua/store/ (the store's
-- side) and lua/ (the algorithms and penalties): bind.lua, begin.lua, this prelude,
-- penalty.lua, one algorithm file (or all of them, for requests under several policies)
-- and main.lua; and the Redis Functions library of every one of them
-- (src/store/redis.rs, `Library`), where begin.lua runs at the start of each call, and
-- one.lua gives each algorithm a function of its own for one plain policy (ARGV: cost,
-- p1, p2, p3, and a test build's time). Each file of lua/ mirrors its twin of the same
-- name in src/algorithm/; the conformance suite checks that both give the same decisions. A script runs as one EVALSHA, so no other client sees or
-- changes the state between the check and the debit, and several policies are
-- all-or-nothing: every policy is checked first, and debited only if all admit.
--
-- Time is Redis TIME in microseconds, never an application server's clock. Numbers are
-- integers kept below 2^53, where Lua's doubles are exact; every division goes through
-- idiv/cdiv, which are exact for such integers. A time goes to a Redis command as its
-- digits, `format('%d', t)` (Redis 7.0 and older spell a number argument with `%.17g`),
-- and a constant argument as a string ('0', not 0): that took the sliding log from 1.17x
-- a minimal script under 1.1x (README, "Script cost"). Other numbers (counts, TTLs,
-- levels) go as numbers: spelling them in Lua measured no cheaper. The digits are what
-- `%.17g` writes, so what is stored is the same either way.
--
-- KEYS: two per policy, KEYS[2i-1] (state) and KEYS[2i] (a penalty's state; without one,
--       the state key again, never read: a second key a Cluster slot being moved would
--       refuse while it is missing). Every key of one identity shares one hash tag, so
--       one Cluster slot.
-- ARGV: [1] now in microseconds, or "" to read TIME (only test builds pass a time),
--       [2] cost, [3] number of policies, then per policy: kind, p1, p2, p3.
-- Returns {outcome, policy, retry_after_us, delay_us, then per policy: limit, remaining,
--          reset_us, effective_window_us, then now_us}; outcome 0 = allowed, 1 = denied,
--          2 = the cost can never fit, 3 = denied by a penalty's block. The effective window is draft-11's `t`: how long the client can
--          use no more than `remaining` (the time until one more unit would fit after
--          spending `remaining` now).
--          One plain policy (no shadow, no penalty) of an algorithm with a `one` of its
--          own (every algorithm; the sliding window counter with one sub-window) is sent
--          one key, and returns
--          {outcome, retry_after_us or delay_us, its raw state, now_us}: the store
--          computes the status from the state as `snapshot` would (src/store/redis.rs,
--          `Raw`), which costs Redis nothing.

-- `now`, `cost` and `count` are set by begin.lua (or one.lua) at the start of every call;
-- `max`, `min`, `fmod`, `call`, `format` and `match` are bound by bind.lua (all declared
-- before this prelude: the locals of a script, or of the Functions library).

-- floor(a / b) and ceil(a / b) for integers 0 <= a < 2^53, b > 0: fmod is exact, and so
-- is the division of an exact multiple.
local function idiv(a, b)
  return (a - fmod(a, b)) / b
end
local function cdiv(a, b)
  local r = fmod(a, b)
  local q = (a - r) / b
  if r > 0 then q = q + 1 end
  return q
end
-- floor(a * b / c) and its remainder, for integers 0 <= a, b < 2^50 and 0 < c < 2^50,
-- exact even where a * b passes 2^53 (a daily window in microseconds times a large
-- limit): b is taken one bit at a time, so no intermediate passes 2^52. The quotient
-- saturates at 2^52, far above any limit or window the callers compare it with.
local function muldiv(a, b, c)
  local product = a * b
  if product < 9007199254740992 then
    local r = fmod(product, c)
    return (product - r) / c, r
  end
  local pow = 1
  while pow * 2 <= b do pow = pow * 2 end
  local q, r = 0, 0
  while pow >= 1 do
    q, r = q * 2, r * 2
    if b >= pow then
      b = b - pow
      r = r + a
    end
    local carry = fmod(r, c)
    q = q + (r - carry) / c
    r = carry
    if q >= 4503599627370496 then return 4503599627370496, 0 end
    pow = pow / 2
  end
  return q, r
end
-- A field a read did not find comes back as false: `tonumber(field or default)` reads a
-- stored number or the default, and a stored value that is not a number still fails the
-- script (loudly, through the store's failure mode) instead of reading as empty.


-- Buckets (token bucket, both leaky buckets) keep the level (units missing from full, or
-- queued, times the period) and the time it was last brought up to date; p[2] units leak
-- or refill every p[3] microseconds. Refilling `elapsed` takes exactly `elapsed * p[2]`.
-- The level of the bucket at `key` brought up to now (p2 units every p3 µs), and the time
-- it is up to date (never before a time already stored: time that steps back refills
-- nothing). Tables-free: the one-policy path (`one`) calls it too.
local function bucket_level(key, p2)
  local stored = call('HMGET', key, 'l', 't')
  local last = tonumber(stored[2] or now)
  return max(tonumber(stored[1] or 0) - max(now - last, 0) * p2, 0), max(last, now)
end

local function write_bucket(key, p2, level, last)
  call('HSET', key, 'l', level, 't', format('%d', last))
  -- Empty ceil(level / p2) µs after `last`, which is later than now when time stepped
  -- back (the level is as of then): in ms from now, ceil((level + (last - now) * p2) /
  -- (p2 * 1000)) (ceil of a ceil is one ceil); the millisecond added covers a product
  -- past 2^53, rounded.
  call('PEXPIRE', key, cdiv(level + max(last - now, 0) * p2, p2 * 1000) + 1)
end

local function load_bucket(p, key)
  local level, last = bucket_level(key, p[2])
  return { key = key, level = level, last = last }
end

local function store_bucket(p, s)
  write_bucket(s.key, p[2], s.level, s.last)
end

-- The status of a bucket's level or a GCRA's TAT ahead of now (`level`, units times p3;
-- p1 units fit, p2 per p3): limit, remaining, reset, effective window, and what is owed
-- past full. Effective window: until the unit being refilled now is whole (past full,
-- once what a settle left owing is paid too).
local function level_status(p, level)
  local full = p[1] * p[3]
  local spare = max(full - level, 0)
  local effective = cdiv(p[3] - fmod(spare, p[3]), p[2])
  local owed = 0
  if level > full then
    effective = cdiv(level - full + p[3], p[2])
    owed = cdiv(level - full, p[3])
  end
  return p[1], idiv(spare, p[3]), cdiv(level, p[2]), effective, owed
end

local function commit_bucket(p, s)
  s.level = s.level + cost * p[3]
  store_bucket(p, s)
end

-- The one-policy path of a bucket (`one` in token_bucket.lua and leaky_shape.lua), given
-- its `fits(p1, p2, p3, level)`, which answers 'admit' (and the delay), 'deny' (and the
-- wait) or 'never'. Takes the policy's arguments as sent (strings) and replies {outcome,
-- delay or wait, level, now}; src/store/redis.rs reports the status from the level, as
-- the algorithm's `snapshot` would.
local function bucket_one(fits)
  return function(key, p1, p2, p3)
    p1, p2, p3 = tonumber(p1), tonumber(p2), tonumber(p3)
    local level, last = bucket_level(key, p2)
    local verdict, value = fits(p1, p2, p3, level)
    if verdict == 'admit' then
      if cost > 0 then
        level = level + cost * p3
        write_bucket(key, p2, level, last)
      end
      return { 0, value, level, now }
    elseif verdict == 'deny' then
      return { 1, value, level, now }
    end
    return { 2, 0, level, now }
  end
end

-- What to give back of `units` debited at `at` (-1: any time), in level units: no more
-- than a replay with the smaller debit would hold now. The replay's deficit was the one
-- the debit left (from `left` of a quota of `limit`) less `units`: what refilled beyond
-- it found the replay full and is lost. Unknown `left`: all the refill is lost.
local function refund_level(p, units, at, limit, left)
  local back = units * p[3]
  if at < 0 then return back end
  -- The replay kept `room` until full: the deficit the debit left (at least `back`).
  local room = back
  if left ~= nil then room = max(max(limit - left, 0) * p[3], back) end
  local elapsed = max(now - at, 0)
  if elapsed >= cdiv(room, p[2]) then return 0 end
  return min(back, room - elapsed * p[2])
end

-- Gives `units` back: the level drops, never below empty.
local function refund_bucket(p, s, units, at, left)
  s.level = max(s.level - refund_level(p, units, at, p[1], left), 0)
  store_bucket(p, s)
end

-- A reply's statuses: each policy's limit, remaining, reset and effective window appended
-- to `reply` (its head: outcome, policy, wait, delay), then the time.
local function with_statuses(reply, policies)
  for i = 1, count do
    local limit, remaining, reset, effective = policies[i].algorithm.snapshot(policies[i].p, policies[i].s)
    reply[#reply + 1] = limit
    reply[#reply + 1] = remaining
    reply[#reply + 1] = reset
    reply[#reply + 1] = effective
  end
  reply[#reply + 1] = now
  return reply
end

-- Sets `key` to expire in `ms` milliseconds, unless it already lives longer (a key that
-- holds several things keeps the longest need).
local function extend_ttl(key, ms)
  local ttl = call('PTTL', key)
  if ttl < ms then call('PEXPIRE', key, ms) end
end

-- A policy's kind argument: the algorithm's two letters, then `~` for a shadow policy,
-- then `!denials:within:block:max_block` (microseconds) for a penalty.
local function parse_kind(raw)
  local kind, rest = match(raw, '^(%a%a)(.*)$')
  if kind == nil then return raw, false, nil end
  local shadow = false
  if string.sub(rest, 1, 1) == '~' then
    shadow = true
    rest = string.sub(rest, 2)
  end
  local penalty = nil
  local n, w, b, m = match(rest, '^!(%d+):(%d+):(%d+):(%d+)$')
  if n ~= nil then penalty = { tonumber(n), tonumber(w), tonumber(b), tonumber(m) } end
  return kind, shadow, penalty
end

