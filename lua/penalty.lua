-- tollgate: penalties, the twin of src/algorithm/penalty.rs (after the prelude, whose
-- helpers it uses: extend_ttl, cdiv). The state lives in the policy's
-- auxiliary hash: denials in the window (pc), its end (pw), blocked until (pb), blocks so
-- far (ps) and when they are forgotten (pm).
local function load_penalty(aux)
  local v = call('HMGET', aux, 'pc', 'pw', 'pb', 'ps', 'pm')
  return {
    aux = aux, count = tonumber(v[1] or 0), window_end = tonumber(v[2] or 0),
    blocked_until = tonumber(v[3] or 0), strikes = tonumber(v[4] or 0),
    strikes_until = tonumber(v[5] or 0),
  }
end

local function strike(pen, st)
  if now >= st.window_end then
    st.count = 0
    st.window_end = now + pen[2]
  end
  st.count = st.count + 1
  if st.count >= pen[1] then
    if now >= st.strikes_until then st.strikes = 0 end
    local block = pen[3]
    for _ = 1, st.strikes do
      block = min(block * 2, pen[4])
      if block == pen[4] then break end
    end
    st.blocked_until = now + block
    st.strikes = min(st.strikes + 1, 64)
    st.strikes_until = st.blocked_until + pen[4]
    st.count = 0
    st.window_end = now
  end
  call('HSET', st.aux, 'pc', st.count, 'pw', format('%d', st.window_end),
    'pb', format('%d', st.blocked_until), 'ps', st.strikes,
    'pm', format('%d', st.strikes_until))
  local fresh = st.blocked_until
  if st.strikes > 0 then fresh = max(fresh, st.strikes_until) end
  if st.count > 0 then fresh = max(fresh, st.window_end) end
  extend_ttl(st.aux, cdiv(max(fresh - now, 0), 1000) + 1)
end
