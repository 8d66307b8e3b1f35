-- Adjusting an admitted request's debit once its response is known, after the prelude
-- and every algorithm: the twin of `adjust` in src/store/decide.rs. ARGV as for a
-- decision (ARGV[2] is the units reserved), then the actual units, the time of the debit
-- in microseconds, and 1 to free the in-flight slots instead of settling. Rate policies
-- give back what they still hold of the difference, or charge the extra as far as they
-- have room; in-flight policies free this request's slot. Returns what a decision returns,
-- outcome 0.

local tail = 3 + count * 4
local actual = tonumber(ARGV[tail + 1])
local at = tonumber(ARGV[tail + 2])
local release = ARGV[tail + 3] == '1'
local reserved = cost

local policies = {}
for i = 1, count do
  local base = 3 + (i - 1) * 4
  local kind = ARGV[base + 1]
  local algorithm = algorithms[kind]
  if algorithm == nil then
    return redis.error_reply('tollgate: this script has no algorithm ' .. tostring(kind))
  end
  local p = { tonumber(ARGV[base + 2]), tonumber(ARGV[base + 3]), tonumber(ARGV[base + 4]) }
  local s = algorithm.load(p, KEYS[2 * i - 1], KEYS[2 * i])
  if kind == 'cc' then
    if release and reserved > 0 then algorithm.refund(p, s, 1, at) end
  elseif not release then
    if actual < reserved then
      algorithm.refund(p, s, reserved - actual, at)
    elseif actual > reserved then
      local _, remaining = algorithm.snapshot(p, s)
      local extra = math.min(actual - reserved, remaining)
      if extra > 0 then
        cost = extra
        algorithm.commit(p, s)
        cost = reserved
      end
    end
  end
  policies[i] = { algorithm = algorithm, p = p, s = s }
end

local reply = { 0, 0, 0, 0 }
for i = 1, count do
  local limit, remaining, reset, effective = policies[i].algorithm.snapshot(policies[i].p, policies[i].s)
  reply[#reply + 1] = limit
  reply[#reply + 1] = remaining
  reply[#reply + 1] = reset
  reply[#reply + 1] = effective
end
reply[#reply + 1] = now
return reply
