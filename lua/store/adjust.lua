-- Adjusting a key's state, after the prelude and every algorithm: the twin of `adjust` in
-- src/store/decide.rs. ARGV as for a decision (ARGV[2] is the units reserved, or the
-- request's cost for a release), then an amount, the time of the debit in microseconds
-- (-1: any time, newest debits first) and the mode:
--   0 settle: rate policies give back `reserved - amount` or charge the excess, past
--     empty if need be (one whole quota more at most, a thousand owed in all);
--   1 release: in-flight policies free this request's slot;
--   2 grant: rate policies give back `amount` units;
--   3 set: rate policies are set to `amount` units left (at most their quota);
--   4 unbook: a request a shaping policy held back was dropped before it was sent: when
--     every shaping policy's queue still ends where its debit left it (the next ARGV,
--     comma-separated, in microseconds; a drained queue beside one still waiting is
--     passed over), rate policies give back all `reserved` units as a settle to nothing
--     would (a shaping policy its whole booking); else nothing changes, and the reply is
--     a denial by the first shaping policy whose queue moved on (or the first drained,
--     when all have).
-- Returns what a decision returns, outcome 0 (or 1 for an unbooking refused).

local tail = 3 + count * 4
local amount = tonumber(ARGV[tail + 1])
local at = tonumber(ARGV[tail + 2])
local mode = ARGV[tail + 3]
-- The indices of the policies the request did not debit (shadow policies that would have
-- denied), comma-separated: a settle or a release leaves them alone.
local undebited = {}
for index in string.gmatch(ARGV[tail + 4] or '', '%d+') do undebited[tonumber(index) + 1] = true end
-- What the debit left of each policy, in order (empty: unknown): a bucket or GCRA gives
-- back what a replay with the actual cost would hold.
local left = {}
for units in string.gmatch(ARGV[tail + 5] or '', '%d+') do left[#left + 1] = tonumber(units) end
-- An unbooking's queue ends, in order.
local ends = {}
for t in string.gmatch(ARGV[tail + 6] or '', '%d+') do ends[#ends + 1] = tonumber(t) end
local reserved = cost

-- Takes `units` more, past empty if need be (the excess is owed: the key waits until it
-- is paid): one call owes at most one whole quota more, and the key at most a thousand
-- quotas and never past MAX_LIMIT (999,999,999,999,999) units. The twin of `charge` in
-- src/store/decide.rs.
local function charge(algorithm, p, s, units)
  local limit, remaining, _, _, owed = algorithm.snapshot(p, s)
  local bound = min(limit * 1000, 999999999999999)
  local extra = min(units, remaining + min(limit, max(bound - owed, 0)))
  if extra > 0 then
    cost = extra
    algorithm.commit(p, s)
    cost = reserved
  end
end

-- Every state is read before any is changed: a state its load cannot read (a value
-- tollgate did not write) fails the call before any policy is refunded or charged (a
-- load only drops what has expired).
local policies = {}
for i = 1, count do
  local base = 3 + (i - 1) * 4
  local kind = parse_kind(ARGV[base + 1])
  local algorithm = algorithms[kind]
  if algorithm == nil then
    return redis.error_reply('tollgate: this script has no algorithm ' .. tostring(kind))
  end
  local p = { tonumber(ARGV[base + 2]), tonumber(ARGV[base + 3]), tonumber(ARGV[base + 4]) }
  policies[i] = { algorithm = algorithm, p = p, kind = kind,
    s = algorithm.load(p, KEYS[2 * i - 1], KEYS[2 * i]) }
end

-- The answer: `head` with every policy's status, a blocked policy told its block (nothing
-- left, restored no sooner than the block ends), as a decision tells it. The twin of
-- `adjusted_statuses` in src/store/decide.rs.
local function answer(head)
  local reply = with_statuses(head, policies)
  for i = 1, count do
    local _, _, penalty = parse_kind(ARGV[3 + (i - 1) * 4 + 1])
    if penalty ~= nil then
      local st = load_penalty(KEYS[2 * i])
      if now < st.blocked_until then
        local left, at = st.blocked_until - now, 4 + (i - 1) * 4
        reply[at + 2] = 0
        reply[at + 3] = max(reply[at + 3], left)
        reply[at + 4] = max(reply[at + 4], left)
      end
    end
  end
  return reply
end

-- An unbooking gives back only the newest booking of each shaping policy: its queue
-- still ends where the debit left it. A drained queue beside one still waiting is passed
-- over (nothing to give back, no one behind: a slower policy's delay outlasts a faster
-- one's queue); when all have drained, the booking's time has passed. The twin of
-- `queue_moved_on` in src/store/decide.rs.
if mode == '4' then
  local drained, waiting = nil, false
  for i = 1, count do
    local algorithm, p, s = policies[i].algorithm, policies[i].p, policies[i].s
    if not undebited[i] and algorithm.queue_end ~= nil then
      local ends_at = algorithm.queue_end(p, s)
      if ends_at <= now then
        drained = drained or i
      elseif ends[i] ~= ends_at then
        return answer({ 1, i, 0, 0 })
      else
        waiting = true
      end
    end
  end
  if drained ~= nil and not waiting then
    return answer({ 1, drained, 0, 0 })
  end
end

for i = 1, count do
  local algorithm, p, s, kind = policies[i].algorithm, policies[i].p, policies[i].s,
    policies[i].kind
  if undebited[i] and (mode == '0' or mode == '1' or mode == '4') then
    -- Nothing was taken: nothing to give back.
  elseif mode == '1' then
    if kind == 'cc' and reserved > 0 then algorithm.refund(p, s, 1, at) end
  elseif kind == 'cc' then
    -- Slots are taken and freed by requests only.
  elseif mode == '0' then
    if amount < reserved then
      algorithm.refund(p, s, reserved - amount, at, left[i])
    elseif amount > reserved then
      charge(algorithm, p, s, amount - reserved)
    end
  elseif mode == '4' then
    if kind == 'ls' then
      algorithm.refund(p, s, reserved, -1)
    else
      algorithm.refund(p, s, reserved, at, left[i])
    end
  elseif mode == '2' then
    algorithm.refund(p, s, amount, -1)
  elseif mode == '3' then
    local limit, remaining, _, _, owed, excess = algorithm.snapshot(p, s)
    local target = min(amount, limit)
    if target > remaining then
      -- What is owed is forgiven too: the level is set, not credited. (`excess` is what
      -- is owed, but for the shaping bucket, whose admissions queue past it too.)
      algorithm.refund(p, s, target - remaining + (excess or owed), -1)
    elseif owed > 0 then
      -- Nothing left (owing), and nothing wanted: what is owed goes.
      algorithm.refund(p, s, owed, -1)
    elseif remaining > target then
      charge(algorithm, p, s, remaining - target)
    end
  end
end

return answer({ 0, 0, 0, 0 })
