defmodule FlashGen.Test.Tensors do
  @moduledoc "Tensors as binaries for the tests: random inputs, decoding, errors, a float64 reference."

  @doc "n standard-normal elements of `type` (native endian)."
  def normal(n, type), do: for(_ <- 1..n//1, into: <<>>, do: encode(:rand.normal(), type))

  defp encode(x, :f32), do: <<x::float-32-native>>
  defp encode(x, :f16), do: <<x::float-16-native>>
  # bf16: the upper half of the f32 (truncated: any bf16 value is a valid input)
  defp encode(x, :bf16), do: (<<hi::16, _::16>> = <<x::float-32-big>>; <<hi::16-native>>)

  @doc "The elements of a binary as floats; NaN and infinities as `:nonfinite`."
  def floats(bin, :f32), do: for(<<x::binary-4 <- bin>>, do: f32(x))
  def floats(bin, :f16), do: for(<<x::binary-2 <- bin>>, do: f16(x))
  def floats(bin, :bf16), do: for(<<b::16-native <- bin>>, do: f32_big(<<b::16, 0::16>>))
  def floats(bin, :f64), do: for(<<x::binary-8 <- bin>>, do: f64(x))

  defp f32(<<x::float-32-native>>), do: x
  defp f32(_), do: :nonfinite
  defp f32_big(<<x::float-32-big>>), do: x
  defp f32_big(_), do: :nonfinite
  defp f16(<<x::float-16-native>>), do: x
  defp f16(_), do: :nonfinite
  defp f64(<<x::float-64-little>>), do: x
  defp f64(_), do: :nonfinite

  @doc "max |got - want| / max(1, max |want|): flashgen's error measure (tests/test_cpu_numerics.py)."
  def rel_error(got, want) when length(got) == length(want) do
    if Enum.any?(got ++ want, &(&1 == :nonfinite)) do
      :infinity
    else
      diff = got |> Enum.zip_with(want, &abs(&1 - &2)) |> Enum.max(fn -> 0.0 end)
      diff / max(1.0, want |> Enum.map(&abs/1) |> Enum.max(fn -> 0.0 end))
    end
  end

  @doc "Forward attention in float64 on flat BSHD lists (GQA, top-left causal): o, flat."
  def reference(q, k, v, {b, sq, hq, d}, {_, sk, hkv, _}, scale, causal) do
    {q, k, v} = {List.to_tuple(q), List.to_tuple(k), List.to_tuple(v)}
    group = div(hq, hkv)

    for bb <- 0..(b - 1), i <- 0..(sq - 1), h <- 0..(hq - 1) do
      qi = ((bb * sq + i) * hq + h) * d
      row = fn j -> ((bb * sk + j) * hkv + div(h, group)) * d end
      keys = if causal, do: 0..min(i, sk - 1), else: 0..(sk - 1)
      s = for j <- keys, do: {j, scale * Enum.reduce(0..(d - 1), 0.0, &(&2 + elem(q, qi + &1) * elem(k, row.(j) + &1)))}
      m = s |> Enum.map(&elem(&1, 1)) |> Enum.max()
      p = for {j, x} <- s, do: {j, :math.exp(x - m)}
      l = p |> Enum.map(&elem(&1, 1)) |> Enum.sum()
      for x <- 0..(d - 1), do: Enum.reduce(p, 0.0, fn {j, w}, acc -> acc + w * elem(v, row.(j) + x) end) / l
    end
    |> List.flatten()
  end
end
