-- The Functions library's entry for one plain policy (no shadow, no penalty): one
-- function per algorithm, `tollgate_one_<kind>_<version>`, so the call names its
-- algorithm and carries no policy count or kind. The same decision as main.lua's path for
-- one policy, without its dispatch: the store sends most decisions here.
--
-- KEYS: [1] the policy's state key.
-- ARGV: [1] cost, [2] p1, [3] p2, [4] p3, then (test builds only) [5] now in
--       microseconds; without it, Redis TIME. (begin.lua's calls always carry a time
--       argument, "" for Redis TIME: a call here has one argument less.)
-- Returns the algorithm's `one` answer: {outcome, retry_after_us or delay_us, its raw
-- state, now_us} (prelude.lua).
local function one_entry(kind)
  local one = algorithms[kind].one
  return function(keys, args)
    if call == nil then check_integers() bind() end
    -- No `one` reads them; a previous call's must not be there to read.
    KEYS, ARGV = nil, nil
    local at = args[5]
    if at == nil then
      local time = call('TIME')
      now = tonumber(time[1]) * 1000000 + tonumber(time[2])
    else
      now = tonumber(at)
    end
    cost, count = tonumber(args[1]), 1
    -- nil: a sliding window counter of several sub-windows, which the store sends to
    -- `decide` instead.
    return one(keys[1], args[2], args[3], args[4])
      or redis.error_reply('tollgate: no one-policy path for these ' .. kind .. ' arguments')
  end
end
