# Compiled only where Nx is installed (a project that depends on :nx); without it this file
# defines nothing, and FlashGen.Attention works on binaries alone.
if Code.ensure_loaded?(Nx) do
  defmodule FlashGen.Attention.Nx do
    @moduledoc """
    `FlashGen.Attention` on Nx tensors (any backend: they cross as
    `Nx.to_binary/1`, results come back with `Nx.from_binary/2`).

        {:ok, {o, lse}} = FlashGen.Attention.Nx.attention(q, k, v, causal: true)
        {:ok, {dq, dk, dv}} = FlashGen.Attention.Nx.attention_grad(q, k, v, o, lse, d_o, causal: true)

    q, k, v share one type (`{:f, 32}`, `{:bf, 16}`, `{:f, 16}`); options as
    `FlashGen.Attention.attention/4` (tensor options may be Nx tensors too).
    """

    alias FlashGen.Attention
    alias FlashGen.Attention.Target

    def attention(q, k, v, opts \\ []) do
      with {:ok, type} <- type(q),
           {:ok, {o, lse}} <- Attention.attention(bin(q), bin(k), bin(v), opts(opts, type)) do
        {:ok, {tensor(o, Nx.type(q)), tensor(lse, {:f, 32})}}
      end
    end

    def attention_grad(q, k, v, o, lse, d_o, opts \\ []) do
      with {:ok, type} <- type(q),
           {:ok, grads} <- Attention.attention_grad(bin(q), bin(k), bin(v), bin(o), bin(lse), bin(d_o), opts(opts, type)) do
        # dq, dk, dv in q's type; dbias (with dbias: true) in f32
        types = [Nx.type(q), Nx.type(q), Nx.type(q), {:f, 32}]
        {:ok, grads |> Tuple.to_list() |> Enum.zip_with(types, &tensor/2) |> List.to_tuple()}
      end
    end

    defp type(t) do
      case Target.dtype(Nx.type(t)) do
        nil -> {:error, "flashgen has no kernels for type #{inspect(Nx.type(t))}"}
        name -> {:ok, String.to_atom(name)}
      end
    end

    defp opts(opts, type), do: [type: type] ++ Enum.map(opts, fn {k, v} -> {k, if(is_struct(v, Nx.Tensor), do: bin(v), else: v)} end)

    defp bin(t), do: {Nx.to_binary(t), Nx.shape(t)}
    defp tensor({data, shape}, type), do: data |> Nx.from_binary(type) |> Nx.reshape(shape)
  end
end
