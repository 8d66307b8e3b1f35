-- The start of every call: its time (Redis TIME in microseconds, or ARGV[1] in test
-- builds), its cost and its number of policies. Assigns the call's `now`, `cost` and
-- `count`, declared before the prelude; binds the locals of bind.lua on a first call.
if call == nil then bind() end
if ARGV[1] ~= '' then
  now = tonumber(ARGV[1])
else
  local time = call('TIME')
  now = tonumber(time[1]) * 1000000 + tonumber(time[2])
end
cost = tonumber(ARGV[2])
count = tonumber(ARGV[3])
