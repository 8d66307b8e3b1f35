-- Coalesced decisions (src/store/redis/coalesce.rs): main.lua, wrapped above as the
-- function `decide`, runs once per decision. After the policies' arguments ARGV holds the
-- number of decisions, then each one's cost. They are decided one after another in that
-- order, at one time, each seeing the state the one before it left: exactly what separate
-- calls arriving in that order would decide. Each answer goes out as its length, then
-- itself.

local base = 4 + 4 * count
local n = tonumber(ARGV[base])
local out = {}
for j = 1, n do
  cost = tonumber(ARGV[base + j])
  local reply = decide()
  if reply.err ~= nil then return reply end
  out[#out + 1] = #reply
  for i = 1, #reply do out[#out + 1] = reply[i] end
end
return out
