-- The globals every call uses most, bound once to locals (declared before this file with
-- `now`, `cost` and `count`): a local is an upvalue away, a global a table lookup. A
-- Functions library cannot read globals while it loads, so the binding happens at the
-- start of a call (begin.lua, or the one-policy entry), once per library; a script binds
-- on each run.
local function bind()
  max, min, fmod = math.max, math.min, math.fmod
  call = redis.call
  format, match = string.format, string.match
end

-- Times go to Redis as `format('%d', t)` (prelude.lua), which Lua 5.1 spells through a
-- C long: a Redis whose long has 32 bits (a 32-bit or a Windows build) would write every
-- time wrong. The Functions library checks at its first call, before it binds anything
-- (so it fails every call, loudly, rather than once); a script does not (a check on every
-- run would cost the fallback about 5%): the store's start-up check (`verify`) does,
-- where the server allows EVAL.
local function check_integers()
  if string.format('%d', 9007199254740992) ~= '9007199254740992' then
    error('tollgate: this Redis formats integers in 32 bits; tollgate needs a 64-bit Redis')
  end
end
