-- The Functions library's first-call check (only the library includes this file).
-- Times go to Redis as `format('%d', t)` (prelude.lua), which Lua 5.1 spells through a
-- C long: a Redis whose long has 32 bits (a 32-bit or a Windows build) would write every
-- time wrong. The Functions library checks at its first call, before it binds anything
-- (so it fails every call, loudly, rather than once); a script does not (a check on every
-- run would cost the fallback about 5%): the store's start-up check (`verify`) does,
-- where the server allows EVAL.
-- The predicate is also what the store's `verify` runs (src/store/redis.rs).
local function integers_ok()
  return string.format('%d', 9007199254740992) == '9007199254740992'
end
local function check_integers()
  if not integers_ok() then
    error('tollgate: this Redis formats integers in 32 bits; tollgate needs a 64-bit Redis')
  end
end
