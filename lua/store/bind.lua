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
