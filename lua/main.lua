-- The decision, after the prelude and the algorithms (each registered in `algorithms`
-- under its kind): check every policy, debit all of them only if all admit, report (and
-- the time of the decision, last).

local policies = {}
local outcome, denying, longest, delay = 0, 0, 0, 0
for i = 1, count do
  local base = 3 + (i - 1) * 4
  local kind = ARGV[base + 1]
  local algorithm = algorithms[kind]
  if algorithm == nil then
    return redis.error_reply('tollgate: this script has no algorithm ' .. tostring(kind))
  end
  local p = { tonumber(ARGV[base + 2]), tonumber(ARGV[base + 3]), tonumber(ARGV[base + 4]) }
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
    policies[i].algorithm.commit(policies[i].p, policies[i].s)
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
return reply
