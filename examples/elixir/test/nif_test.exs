defmodule FlashGen.NIFTest do
  # Needs a library with flashgen_{fwd,bwd}_d64_f32_causal (tests/test_elixir_nif.py builds one).
  use ExUnit.Case, async: false
  @moduletag :nif

  import Bitwise
  import FlashGen.Test.Tensors
  alias FlashGen.{Attention, NIF}

  @target "flashgen_fwd_d64_f32_causal"

  defp qkv(b, sq, sk, hq, hkv, d, type \\ :f32) do
    q = {normal(b * sq * hq * d, type), {b, sq, hq, d}}
    k = {normal(b * sk * hkv * d, type), {b, sk, hkv, d}}
    v = {normal(b * sk * hkv * d, type), {b, sk, hkv, d}}
    {q, k, v}
  end

  test "the Elixir face passes exactly the attributes the library's contract lists" do
    contract = NIF.contract().attributes

    for {direction, opts} <- [
          {"fwd", []},
          {"bwd", [deterministic: false]},
          {"fwd_varlen", [max_seqlen_q: 1, max_seqlen_k: 1]}
        ] do
      names = contract[direction] |> Enum.map(&String.to_atom(elem(&1, 0))) |> Enum.sort()
      assert names == opts |> Attention.attributes(64, []) |> Map.keys() |> Enum.sort()
    end
  end

  test "forward matches a float64 reference computed in Elixir (GQA, causal, Sq != Sk)" do
    {{qb, qs} = q, {kb, ks} = k, {vb, _} = v} = qkv(2, 7, 9, 4, 2, 64)
    assert {:ok, {{o, {2, 7, 4, 64}}, {lse, {2, 4, 7}}}} = Attention.attention(q, k, v, causal: true)
    want = reference(floats(qb, :f32), floats(kb, :f32), floats(vb, :f32), qs, ks, 0.125, true)
    assert rel_error(floats(o, :f32), want) < 2.0e-5
    assert byte_size(lse) == 2 * 4 * 7 * 4
  end

  test "threads: 0 (one worker per CPU) gives the same answer as inline" do
    {q, k, v} = qkv(1, 130, 130, 4, 4, 64)
    {:ok, {{o1, _}, _}} = Attention.attention(q, k, v, causal: true)
    {:ok, {{o0, _}, _}} = Attention.attention(q, k, v, causal: true, threads: 0)
    assert rel_error(floats(o0, :f32), floats(o1, :f32)) < 1.0e-6
  end

  test "bad input is {:error, message} naming the problem, and the VM keeps running" do
    {{qb, qs} = q, k, v} = qkv(1, 4, 4, 2, 2, 64)
    attrs = Attention.attributes([causal: true], 64, [])
    good = [{:f32, qs, qb}, {:f32, qs, elem(k, 0)}, {:f32, qs, elem(v, 0)}]
    outs = [{:f32, qs}, {:f32, {1, 2, 4}}]
    huge = 1 <<< 40

    bad = [
      # wrong sizes
      {NIF.call(@target, [{:f32, qs, binary_part(qb, 0, 100)} | tl(good)], outs, attrs), "binary has 100 bytes"},
      {Attention.attention(q, {elem(k, 0), {1, 4, 3, 64}}, v, causal: true), "needs 3072"},
      {NIF.call(@target, good, [{:f32, {1, 2, 4, 64}}, {:f32, {1, 2, 4}}], attrs), "o has shape [1, 2, 4, 64]"},
      {Attention.attention(q, {elem(k, 0), {1, 2, 4, 64}}, {elem(v, 0), {1, 2, 4, 64}}, causal: true),
       "kv heads (4) must divide q heads (2)"},
      {Attention.attention(q, k, {elem(v, 0), {1, 2, 4, 64}}, causal: true), "k and v shapes differ"},
      # wrong dtype tag
      {NIF.call(@target, [{:f64, qs, qb} | tl(good)], outs, attrs), "type f64 is not one of"},
      {NIF.call(@target, [{:bf16, {1, 4, 2, 128}, qb} | tl(good)], outs, attrs), "expected F32 but got BF16"},
      {NIF.call(@target, [{:f32, {1, 4, 1, 128}, qb} | tl(good)], outs, attrs), "q head_dim is 128"},
      {Attention.attention(q, k, v, type: :f64), "type must be one of"},
      {NIF.call(@target, [{:i32, qs, qb} | tl(good)], outs, attrs), "Wrong buffer dtype"},
      # non-binary terms
      {NIF.call(@target, [{:f32, qs, :erlang.binary_to_list(qb)} | tl(good)], outs, attrs), "must be a binary"},
      {NIF.call(@target, :not_a_list, outs, attrs), "operands must be a list"},
      {NIF.call(@target, good, outs, [causal: true]), "attributes must be a map"},
      {NIF.call(:flashgen_fwd, good, outs, attrs), "the target must be a binary"},
      {NIF.call(@target, [{:f32, [1, 4], qb} | tl(good)], outs, attrs), "is not a tuple"},
      {NIF.call(@target, [{:f32, {1, -4, 2, 64}, qb} | tl(good)], outs, attrs), "not a non-negative integer"},
      {Attention.attention(q, :k, v), "a tensor is {binary, shape}"},
      {NIF.call(@target, good, outs, %{attrs | causal: 1}), "attribute causal must be i1"},
      {NIF.call(@target, good, outs, %{attrs | window_left: 1 <<< 31}), "attribute window_left must be i32"},
      {NIF.call(@target, good, outs, %{attrs | scale: 1.0e300}), "within the f32 range"},
      {NIF.call(@target, good, outs, Map.put(attrs, :dropout, 0.1)), "does not take"},
      {NIF.call(@target, good, outs, Map.delete(attrs, :softcap)), "attribute softcap is missing"},
      {NIF.call("flashgen_fwd_d48_f32", good, outs, attrs), "unknown target"},
      # huge shapes
      {NIF.call(@target, [{:f32, {huge, huge, 2, 64}, qb} | tl(good)], outs, attrs), "more elements than memory"},
      {NIF.call(@target, good, [{:f32, {huge, huge, huge, 64}}, {:f32, {1, 2, 4}}], attrs), "more elements than memory"},
      {NIF.call(@target, good, [{:f32, {1 <<< 20, 1 <<< 20, 1 <<< 10, 64}}, {:f32, {1, 2, 4}}], attrs),
       "cannot allocate"},
      {NIF.call(@target, List.duplicate(hd(good), 17), outs, attrs), "at most 16"},
      # values the kernel refuses
      {Attention.attention(q, k, v, causal: false, bottom_right: true), "bottom_right=true needs"},
      {NIF.call(@target, good, outs, %{attrs | causal: false}), "does not match this kernel"},
      {Attention.attention(q, k, v, causal: true, softcap: 1.0e-39), "subnormal"},
      {Attention.attention(q, k, v, causal: true, window: {-2, 0}), "window_left / window_right must be >= -1"},
      {Attention.attention(q, k, v, causal: true, window: 8), "window must be {left, right}"},
      {Attention.attention(q, k, v, causal: true, scale: -1.0), "scale must be a finite positive"},
      {NIF.call(@target, good, outs, %{attrs | extras: "mask,alibi"}), "unknown, repeated or out of order"},
      {Attention.attention(q, k, v, causal: true, key_lengths: [4, 4]), "key_lengths must be a list of one"},
      {Attention.attention(q, k, v, causal: true, alibi_slopes: {<<0::32>>, {1}}), "alibi_slopes has shape [1]"},
      {Attention.attention_varlen({qb, {4, 2, 64}}, {elem(k, 0), {4, 2, 64}}, {elem(v, 0), {4, 2, 64}}, [0, 3, 2], [0, 2, 4],
         causal: true), "cu_seqlens_q decreases"},
      {Attention.attention_varlen({qb, {4, 2, 64}}, {elem(k, 0), {4, 2, 64}}, {elem(v, 0), {4, 2, 64}}, [0, :x], [0, 4]),
       "must be lists of int32"}
    ]

    for {result, expected} <- bad do
      assert {:error, message} = result
      assert message =~ expected
    end

    # the VM, this process and the library are still fine: a good call gives the right answer
    assert {:ok, {{o, _}, _}} = Attention.attention(q, k, v, causal: true)
    want = reference(floats(qb, :f32), floats(elem(k, 0), :f32), floats(elem(v, 0), :f32), qs, qs, 0.125, true)
    assert rel_error(floats(o, :f32), want) < 2.0e-5
  end

  test "a long call runs on a dirty scheduler: a 1 ms ticker on the only normal scheduler keeps its pace" do
    block = normal(64 * 4 * 64, :f32)
    [q, k, v] = for _ <- 1..3, do: {:binary.copy(block, 64), {1, 2048, 8, 64}}
    # B*Sq*Sk*Hq*D: far above what the NIF runs on a normal scheduler
    assert 2048 * 2048 * 8 * 64 > NIF.contract().inline_work
    online = :erlang.system_info(:schedulers_online)
    # one normal scheduler: a NIF holding it would stop every other process
    :erlang.system_flag(:schedulers_online, 1)

    try do
      parent = self()
      ticker = spawn_link(fn -> tick(parent, System.monotonic_time(:microsecond), 0) end)
      Process.sleep(20)
      {micros, {:ok, _}} = :timer.tc(fn -> Attention.attention(q, k, v) end)
      send(ticker, :stop)
      assert_receive {:max_gap, gap}, 1000
      IO.puts("\n  dirty scheduler: a #{div(micros, 1000)} ms call; the 1 ms ticker's longest gap #{div(gap, 1000)} ms")
      assert micros > 20_000, "the call is too short (#{micros} us) to show anything"
      assert gap < micros / 2, "the ticker stalled #{gap} us during a #{micros} us call"
    after
      :erlang.system_flag(:schedulers_online, online)
    end
  end

  defp tick(parent, last, max_gap) do
    receive do
      :stop -> send(parent, {:max_gap, max_gap})
    after
      1 ->
        now = System.monotonic_time(:microsecond)
        tick(parent, now, max(max_gap, now - last))
    end
  end
end
