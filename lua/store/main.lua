-- The decision, after the prelude and the algorithms (each registered in `algorithms`
-- under its kind): check every policy, debit all of them only if all admit, report (then
-- the time of the decision, then the indices of the shadow policies that would have
-- denied). A shadow policy (kind `xx~`) is decided, never denies, and is debited only if
-- it would have admitted. A policy with a penalty (kind `xx!...`) blocks a key it keeps
-- denying: a blocked key is answered from the block, nothing spent. The outcome is 0
-- admitted, 1 denied, 2 a cost that never fits, 3 denied by a block (which counts towards
-- nothing: a deny cache may answer the same until it ends).

-- One policy of a plain kind (no shadow, no penalty): the store's most common call. The
-- same decision as the loop below (a lone policy denies alone, and nothing can block it),
-- without the loop's tables and closures.
local single = count == 1 and algorithms[ARGV[4]]
-- An algorithm with a path of its own for one policy answers its raw state (see its
-- `one`): src/store/redis.rs reports the status from it, which costs Redis nothing.
if single and single.one then
  local reply = single.one(KEYS[1], ARGV[5], ARGV[6], ARGV[7])
  if reply then return reply end
end
if single then
  local p = { tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7]) }
  local s = single.load(p, KEYS[1], KEYS[2])
  local verdict, value = single.check(p, s)
  local outcome, denying, longest, delay = 0, 0, 0, 0
  if verdict == 'never' then
    outcome, denying = 2, 1
  elseif verdict == 'deny' then
    outcome, denying, longest = 1, 1, value
  else
    if value > 0 then delay = value end
    if cost > 0 then single.commit(p, s) end
  end
  local limit, remaining, reset, effective = single.snapshot(p, s)
  return { outcome, denying, longest, delay, limit, remaining, reset, effective, now }
end

-- The policies' parameters and penalties, read once.
local specs = {}
for i = 1, count do
  local base = 3 + (i - 1) * 4
  local kind, shadow, penalty = parse_kind(ARGV[base + 1])
  local algorithm = algorithms[kind]
  if algorithm == nil then
    return redis.error_reply('tollgate: this script has no algorithm ' .. tostring(kind))
  end
  specs[i] = {
    algorithm = algorithm, shadow = shadow, penalty = penalty,
    p = { tonumber(ARGV[base + 2]), tonumber(ARGV[base + 3]), tonumber(ARGV[base + 4]) },
  }
  if penalty ~= nil then specs[i].penalty_state = load_penalty(KEYS[2 * i]) end
end

-- The answer to a blocked key, or nil: denied until its block ends, or until the
-- policies would admit the cost (at least one unit: a peek is told when a request would
-- pass) if that is later, so a block never states a shorter wait than the denials it
-- stands for; by the policy keeping the client waiting longest (the first of equals).
-- Nothing is spent. Nil too when a policy can never admit the cost: that request is told
-- so (no wait would let it through), as it would be without the block.
local function blocked_reply()
  local longest, denier = 0, 0
  for i = 1, count do
    local st = specs[i].penalty_state
    if st ~= nil and now < st.blocked_until and st.blocked_until - now > longest then
      longest, denier = st.blocked_until - now, i
    end
  end
  if denier == 0 then return nil end
  local asked = cost
  if cost < 1 then cost = 1 end
  -- The outcome's denier and wait are filled in once every policy is read. Outcome 3:
  -- denied by a block (nothing counted; a cache may answer the same until it ends), and
  -- in the place of the delay how long the block goes on (the policies' waits may be
  -- longer).
  local reply = { 3, 0, 0, longest }
  for i = 1, count do
    local spec = specs[i]
    local s = spec.algorithm.load(spec.p, KEYS[2 * i - 1], KEYS[2 * i])
    local limit, remaining, reset, effective = spec.algorithm.snapshot(spec.p, s)
    local st = spec.penalty_state
    if st ~= nil and now < st.blocked_until then
      local left = st.blocked_until - now
      remaining, reset, effective = 0, max(reset, left), max(effective, left)
    end
    if not spec.shadow then
      local verdict, value = spec.algorithm.check(spec.p, s)
      if verdict == 'deny' and value > longest then longest, denier = value, i end
      if verdict == 'never' then
        cost = asked
        return nil
      end
    end
    reply[#reply + 1] = limit
    reply[#reply + 1] = remaining
    reply[#reply + 1] = reset
    reply[#reply + 1] = effective
  end
  cost = asked
  reply[2], reply[3] = denier, longest
  reply[#reply + 1] = now
  return reply
end

local blocked = blocked_reply()
if blocked ~= nil then return blocked end

local policies = {}
local outcome, denying, longest, delay = 0, 0, 0, 0
local shadow_denied = {}
for i = 1, count do
  local shadow = specs[i].shadow
  local algorithm = specs[i].algorithm
  local p = specs[i].p
  local s = algorithm.load(p, KEYS[2 * i - 1], KEYS[2 * i])
  local verdict, value = algorithm.check(p, s)
  specs[i].verdict = verdict
  local debit = true
  if shadow then
    if verdict ~= 'admit' then
      shadow_denied[#shadow_denied + 1] = i - 1
      debit = false
    end
  elseif verdict == 'never' then
    if outcome ~= 2 then outcome, denying = 2, i end
  elseif verdict == 'deny' then
    if outcome == 0 or (outcome == 1 and value > longest) then
      outcome, denying, longest = 1, i, value
    end
  elseif value > delay then
    delay = value
  end
  policies[i] = { algorithm = algorithm, p = p, s = s, debit = debit }
end

if outcome == 0 and cost > 0 then
  for i = 1, count do
    if policies[i].debit then
      policies[i].algorithm.commit(policies[i].p, policies[i].s)
    end
  end
end

-- Each denial counts towards its policy's penalty; one may start a block, which this
-- answer already shows.
local struck = false
for i = 1, count do
  local spec = specs[i]
  -- A request that costs nothing (a peek) is no offence, and neither is one that can
  -- never fit (outcome 2): it is refused for what it is, not counted toward a block it
  -- could never wait out.
  if spec.penalty_state ~= nil and not spec.shadow and spec.verdict == 'deny' and cost > 0
    and outcome ~= 2 then
    strike(spec.penalty, spec.penalty_state)
    struck = true
  end
end
if struck then
  blocked = blocked_reply()
  if blocked ~= nil then return blocked end
end

-- The time of the decision, last of the statuses: the receipt a later adjustment
-- refers to.
local reply = with_statuses({ outcome, denying, longest, delay }, policies)
for _, index in ipairs(shadow_denied) do reply[#reply + 1] = index end
return reply
