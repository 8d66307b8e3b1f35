-- The decision, after the prelude and the algorithms (each registered in `algorithms`
-- under its kind): check every policy, debit all of them only if all admit, report (then
-- the time of the decision, then the indices of the shadow policies that would have
-- denied). A kind ending in `~` is a shadow policy: decided, never denying, debited only
-- if it would have admitted.

local policies = {}
local outcome, denying, longest, delay = 0, 0, 0, 0
local shadow_denied = {}
for i = 1, count do
  local base = 3 + (i - 1) * 4
  local kind = ARGV[base + 1]
  local shadow = string.sub(kind, -1) == '~'
  if shadow then kind = string.sub(kind, 1, -2) end
  local algorithm = algorithms[kind]
  if algorithm == nil then
    return redis.error_reply('tollgate: this script has no algorithm ' .. tostring(kind))
  end
  local p = { tonumber(ARGV[base + 2]), tonumber(ARGV[base + 3]), tonumber(ARGV[base + 4]) }
  local s = algorithm.load(p, KEYS[2 * i - 1], KEYS[2 * i])
  local verdict, value = algorithm.check(p, s)
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

local reply = { outcome, denying, longest, delay }
for i = 1, count do
  local limit, remaining, reset, effective = policies[i].algorithm.snapshot(policies[i].p, policies[i].s)
  reply[#reply + 1] = limit
  reply[#reply + 1] = remaining
  reply[#reply + 1] = reset
  reply[#reply + 1] = effective
end
-- The time of the decision: the receipt a later adjustment refers to.
reply[#reply + 1] = now
for _, index in ipairs(shadow_denied) do reply[#reply + 1] = index end
return reply
