defmodule FlashGen.AttentionTest do
  use ExUnit.Case, async: false

  alias FlashGen.Attention
  alias FlashGen.Attention.{Reference, Target}

  defmodule Model do
    import Nx.Defn

    defn attend(q, k, v), do: FlashGen.Attention.attention(q, k, v, causal: true)

    defn grads(q, k, v) do
      grad({q, k, v}, fn {q, k, v} -> Nx.sum(FlashGen.Attention.attention(q, k, v, causal: true) ** 2) end)
    end

    # the same math without flashgen, for comparison
    defn dense(q, k, v) do
      {_, sq, _, d} = Nx.shape(q)
      s = Nx.dot(q, [3], [0, 2], k, [3], [0, 2]) / Nx.sqrt(d)
      mask = Nx.iota({sq, sq}, axis: 1) <= Nx.iota({sq, sq}, axis: 0)
      s = Nx.select(Nx.broadcast(mask, Nx.shape(s), axes: [2, 3]), s, Nx.Constants.neg_infinity())
      p = Nx.exp(s - Nx.reduce_max(s, axes: [3], keep_axes: true))
      p = p / Nx.sum(p, axes: [3], keep_axes: true)
      Nx.dot(p, [3], [0, 1], v, [1], [0, 2]) |> Nx.transpose(axes: [0, 2, 1, 3])
    end

    defn dense_grads(q, k, v) do
      grad({q, k, v}, fn {q, k, v} -> Nx.sum(dense(q, k, v) ** 2) end)
    end
  end

  defp inputs(d) do
    key = Nx.Random.key(0)
    {q, key} = Nx.Random.normal(key, shape: {1, 8, 2, d})
    {k, key} = Nx.Random.normal(key, shape: {1, 8, 2, d})
    {v, _} = Nx.Random.normal(key, shape: {1, 8, 2, d})
    {q, k, v}
  end

  test "attributes are typed the way the handlers decode them" do
    assert Target.backend_config(true, 0.125, false) ==
             [{"causal", "true"}, {"scale", "0x3E000000 : f32"}, {"bottom_right", "false"}]

    assert Target.name(:bwd, 64, {:bf, 16}, false) == "flashgen_bwd_d64_bf16"
  end

  test "without a loaded library the block compiles to the Nx reference" do
    {q, k, v} = inputs(32)
    got = Nx.Defn.jit_apply(&Model.attend/3, [q, k, v], compiler: Nx.Defn.Evaluator)
    assert Nx.all_close(got, Model.dense(q, k, v), atol: 1.0e-5)
  end

  test "the reference backward matches Nx's own gradient" do
    {q, k, v} = inputs(32)
    {dq, dk, dv} = Nx.Defn.jit_apply(&Model.grads/3, [q, k, v], compiler: Nx.Defn.Evaluator)
    {rq, rk, rv} = Model.dense_grads(q, k, v)
    for {a, b} <- [{dq, rq}, {dk, rk}, {dv, rv}], do: assert(Nx.all_close(a, b, atol: 1.0e-4))
  end

  @tag :kernels
  test "EXLA lowers the blocks to flashgen custom calls and runs them" do
    :ok = Attention.load!(System.fetch_env!("FLASHGEN_EXLA_MANIFEST"))
    {q, k, v} = inputs(32)

    %{mlir_module: mlir} = EXLA.to_mlir_module(&Model.grads/3, [q, k, v])
    assert mlir =~ "stablehlo.custom_call @flashgen_fwd_d32_f32_causal("
    assert mlir =~ "stablehlo.custom_call @flashgen_bwd_d32_f32_causal("
    assert mlir =~ "api_version = 4 : i32"

    assert Nx.all_close(EXLA.jit(&Model.attend/3).(q, k, v), Model.dense(q, k, v), atol: 1.0e-4)
    {dq, dk, dv} = EXLA.jit(&Model.grads/3).(q, k, v)
    {rq, rk, rv} = Model.dense_grads(q, k, v)
    for {a, b} <- [{dq, rq}, {dk, rk}, {dv, rv}], do: assert(Nx.all_close(a, b, atol: 1.0e-3))
  end

  test "the reference keeps flashgen's conventions for rows that see no key" do
    q = Nx.iota({1, 4, 1, 32}, type: :f32) |> Nx.divide(100)
    k = Nx.iota({1, 2, 1, 32}, type: :f32) |> Nx.divide(100)
    tag = %Attention{causal: true, scale: 0.2, bottom_right: true}
    {o, lse} = Reference.forward(q, k, k, tag)
    # bottom-right alignment with Sq = 4 > Sk = 2: rows 0 and 1 see no key
    assert Nx.to_flat_list(o[[0, 0..1]]) |> Enum.all?(&(&1 == 0.0))
    assert Nx.to_flat_list(lse[[0, 0, 0..1]]) == [:neg_infinity, :neg_infinity]
  end
end
