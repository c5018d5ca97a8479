defmodule FlashGen.Attention.Reference do
  @moduledoc """
  Plain Nx attention with flashgen's semantics: the default callback of the
  `FlashGen.Attention` blocks.

  EXLA compiles this instead of the custom call when no flashgen kernel fits
  (see `FlashGen.Attention`), and every other Nx compiler/backend runs it. It
  computes in f32 and materializes the `[B, Hq, Sq, Sk]` probabilities, so it
  is the reference, not the fast path. Same conventions as the kernels: BSHD,
  GQA by head counts, causal `j <= i + offset` (offset `Sk - Sq` when
  `bottom_right`), a row that sees no key gives `o = 0`, `lse = -inf` and zero
  gradients.
  """

  @doc "`{o, lse}`: `o` like `q`, `lse[B, Hq, Sq]` in f32."
  def forward(q, k, v, %{causal: causal, scale: scale, bottom_right: bottom_right}) do
    type = Nx.type(q)
    {q, k, v} = {f32(q), f32(k), f32(v)}
    {p, lse} = probabilities(q, k, causal, scale, bottom_right)
    # [b, hq, sq, sk] . [b, sk, hq, d] -> [b, hq, sq, d]
    o = Nx.dot(p, [3], [0, 1], expand_kv(v, q), [1], [0, 2])
    {o |> Nx.transpose(axes: [0, 2, 1, 3]) |> Nx.as_type(type), lse}
  end

  @doc "`{dq, dk, dv}` for the output gradient `g` (`o`, `lse` as `forward/4` returned them)."
  def backward(q, k, v, o, _lse, g, %{causal: causal, scale: scale, bottom_right: bottom_right}) do
    {_, _, hkv, _} = Nx.shape(k)
    types = {Nx.type(q), Nx.type(k), Nx.type(v)}
    {q, k, v, o, g} = {f32(q), f32(k), f32(v), f32(o), f32(g)}
    {p, _lse} = probabilities(q, k, causal, scale, bottom_right)
    {ke, ve} = {expand_kv(k, q), expand_kv(v, q)}

    # dV = P^T dO: [b, hq, sq, sk] x [b, sq, hq, d] -> [b, hq, sk, d]
    dv = Nx.dot(p, [2], [0, 1], g, [1], [0, 2])
    # dP = dO V^T: [b, sq, hq, d] x [b, sk, hq, d] -> [b, hq, sq, sk]
    dp = Nx.dot(g, [3], [0, 2], ve, [3], [0, 2])
    # dS = P * (dP - rowsum(dO * O)) * scale
    delta = g |> Nx.multiply(o) |> Nx.sum(axes: [3]) |> Nx.transpose(axes: [0, 2, 1]) |> Nx.new_axis(3)
    ds = p |> Nx.multiply(Nx.subtract(dp, delta)) |> Nx.multiply(scale)
    # dQ = dS K: -> [b, hq, sq, d];  dK = dS^T Q: -> [b, hq, sk, d]
    dq = Nx.dot(ds, [3], [0, 1], ke, [1], [0, 2])
    dk = Nx.dot(ds, [2], [0, 1], q, [1], [0, 2])

    {tq, tk, tv} = types

    {dq |> Nx.transpose(axes: [0, 2, 1, 3]) |> Nx.as_type(tq),
     dk |> Nx.transpose(axes: [0, 2, 1, 3]) |> fold_kv(hkv) |> Nx.as_type(tk),
     dv |> Nx.transpose(axes: [0, 2, 1, 3]) |> fold_kv(hkv) |> Nx.as_type(tv)}
  end

  # softmax(scale * q k^T, masked) as [b, hq, sq, sk], and its log-sum-exp [b, hq, sq]
  defp probabilities(q, k, causal, scale, bottom_right) do
    {_, sq, _, _} = Nx.shape(q)
    {_, sk, _, _} = Nx.shape(k)
    s = q |> Nx.dot([3], [0, 2], expand_kv(k, q), [3], [0, 2]) |> Nx.multiply(scale)

    s =
      if causal do
        offset = if bottom_right, do: sk - sq, else: 0
        visible = Nx.less_equal(Nx.iota({sq, sk}, axis: 1), Nx.add(Nx.iota({sq, sk}, axis: 0), offset))
        Nx.select(Nx.broadcast(visible, Nx.shape(s), axes: [2, 3]), s, Nx.Constants.neg_infinity({:f, 32}))
      else
        s
      end

    m = Nx.reduce_max(s, axes: [3], keep_axes: true)
    m = Nx.select(Nx.is_infinity(m), 0.0, m)
    e = Nx.exp(Nx.subtract(s, m))
    l = Nx.sum(e, axes: [3], keep_axes: true)
    p = Nx.divide(e, Nx.select(Nx.equal(l, 0), 1.0, l))
    lse = l |> Nx.log() |> Nx.add(m) |> Nx.squeeze(axes: [3])
    {p, lse}
  end

  # [b, sk, hkv, d] -> [b, sk, hq, d]: q head h reads kv head div(h, hq / hkv)
  defp expand_kv(k, q) do
    {b, sk, hkv, d} = Nx.shape(k)
    {_, _, hq, _} = Nx.shape(q)

    if hq == hkv do
      k
    else
      k |> Nx.new_axis(3) |> Nx.broadcast({b, sk, hkv, div(hq, hkv), d}) |> Nx.reshape({b, sk, hq, d})
    end
  end

  # [b, sk, hq, d] -> [b, sk, hkv, d], summing each kv head's query-head group
  defp fold_kv(x, hkv) do
    {b, sk, hq, d} = Nx.shape(x)
    if hq == hkv, do: x, else: x |> Nx.reshape({b, sk, hkv, div(hq, hkv), d}) |> Nx.sum(axes: [3])
  end

  defp f32(t), do: Nx.as_type(t, {:f, 32})
end
