defmodule FlashGen.ReferenceCasesTest do
  # Cases written by tests/test_elixir_nif.py: fresh random inputs in the kernel's type and the
  # outputs of flashgen/reference.py (float64) for them. Each output's error is asserted here
  # and appended to errors.txt ("case output error tolerance") for the Python side's table.
  use ExUnit.Case, async: false
  @moduletag :cases

  import FlashGen.Test.Tensors
  alias FlashGen.Attention

  @dir System.get_env("FLASHGEN_ELIXIR_CASES")
  @cases if(@dir, do: @dir |> Path.join("cases.exs") |> Code.eval_file() |> elem(0), else: [])

  for c <- @cases do
    @case c
    test "#{c.name} matches flashgen/reference.py" do
      check(@case)
    end
  end

  defp load({file, shape}) when is_binary(file), do: {File.read!(Path.join(@dir, file)), shape}
  defp load(other), do: other

  defp check(c) do
    [q, k, v, d_o] = Enum.map([c.q, c.k, c.v, c.do], &load/1)
    opts = [type: c.type] ++ Enum.map(c.opts, fn {key, value} -> {key, load(value)} end)

    {{o, lse}, grads} =
      case c.kind do
        "dense" ->
          {:ok, {o, lse}} = Attention.attention(q, k, v, opts)
          {:ok, grads} = Attention.attention_grad(q, k, v, o, lse, d_o, opts)
          {{o, lse}, grads}

        "varlen" ->
          {:ok, {o, lse}} = Attention.attention_varlen(q, k, v, c.cu, c.cu, opts)
          {:ok, grads} = Attention.attention_varlen_grad(q, k, v, o, lse, d_o, c.cu, c.cu, opts)
          {{o, lse}, grads}
      end

    got = Enum.zip([:o, :lse, :dq, :dk, :dv, :dbias], [o, lse | Tuple.to_list(grads)])
    assert length(got) == length(c.expect)

    errors =
      for {name, {data, shape}} <- got do
        {file, want_shape} = c.expect[name]
        assert shape == want_shape, "#{name}: shape #{inspect(shape)}, expected #{inspect(want_shape)}"
        type = if name in [:lse, :dbias], do: :f32, else: c.type
        tol = if name in [:o, :lse], do: c.tol[:fwd], else: c.tol[:bwd]
        {name, rel_error(floats(data, type), floats(File.read!(Path.join(@dir, file)), :f64)), tol}
      end

    lines = for {name, err, tol} <- errors, do: "#{c.name} #{name} #{err} #{tol}\n"
    File.write!(Path.join(@dir, "errors.txt"), lines, [:append])
    for {name, err, tol} <- errors, do: assert(err <= tol, "#{c.name} #{name}: error #{err} > #{tol}")
  end
end
