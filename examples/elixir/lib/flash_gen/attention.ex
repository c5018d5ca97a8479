defmodule FlashGen.Attention do
  @moduledoc """
  FlashAttention on binaries, through flashgen's CPU kernels (`FlashGen.NIF`).

      :ok = FlashGen.NIF.load("priv/flashgen")       # flashgen build ... --for nif --out priv/flashgen
      {:ok, {o, lse}} = FlashGen.Attention.attention(q, k, v, type: :f32, causal: true)
      {:ok, {dq, dk, dv}} = FlashGen.Attention.attention_grad(q, k, v, o, lse, d_o, type: :f32, causal: true)

  A tensor is `{binary, shape}`: native-endian elements of `opts[:type]` (`:f32`,
  `:bf16`, `:f16`; default `:f32`) in row-major order. Layout is BSHD:
  `q {B, Sq, Hq, D}`, `k, v {B, Sk, Hkv, D}` with `Hkv` dividing `Hq` (GQA/MQA).
  Results come back the same way: `o` like `q`, `lse {B, Hq, Sq}` in f32
  (natural log); `dq, dk, dv` like `q, k, v`. Everything is flashgen's call
  contract (README "KernelSpec and the custom calls", "Variants"); the kernels
  check it and bad input is `{:error, message}`.

  ## Options

    * `:type` - element type of q, k, v (default `:f32`)
    * `:causal` - key `j` visible to query `i` iff `j <= i + offset` (default `false`)
    * `:scale` - softmax scale (default `1/sqrt(D)`)
    * `:bottom_right` - offset `Sk - Sq` instead of 0 (default `false`)
    * `:window` - `{left, right}` sliding window, -1 = unbounded (default `{-1, -1}`)
    * `:softcap` - scores `x` become `c * tanh(x / c)`; 0 = off (default `0.0`)
    * `:alibi_slopes` - `{binary, {Hq}}` or `{binary, {B, Hq}}`, f32
    * `:bias` - `{binary, {1|B, 1|Hq, Sq, Sk}}`, f32 (added to the scores)
    * `:mask` - `{binary, {1|B, 1|Hq, Sq, Sk}}`, one byte per element, nonzero = visible
    * `:q_segment_ids`, `:kv_segment_ids` - `{binary, {B, Sq}}`, `{binary, {B, Sk}}`, i32
      (key `j` visible to query `i` iff their ids are equal)
    * `:key_lengths` - `[n_b]`, one per batch entry: keys `j >= n_b` are padding
      (passed as segment ids)
    * `:dbias` - `attention_grad/7` also returns the bias's gradient (default `false`)
    * `:threads` - 1 runs the kernels on the scheduler thread that runs the call
      (default), 0 on one worker per CPU
  """

  alias FlashGen.Attention.Target
  alias FlashGen.NIF

  # Element types and their Nx names (Target's, shared with the EXLA example).
  @types %{f32: {:f, 32}, bf16: {:bf, 16}, f16: {:f, 16}}
  # The type of each optional operand (README "Variants"); the order comes from the library.
  @operand_types %{alibi_slopes: :f32, bias: :f32, mask: :pred, q_segment_ids: :i32, kv_segment_ids: :i32}

  @doc "Forward attention: `{:ok, {o, lse}}` or `{:error, message}`."
  def attention(q, k, v, opts \\ []) do
    with {:ok, call} <- prepare(:fwd, [q, k, v], opts),
         do: run(call, [{call.type, shape!(q)}, {:f32, lse_shape(shape!(q))}])
  end

  @doc """
  Gradients of attention for the output cotangent `d_o` (like `q`), given the
  forward's `o` and `lse`: `{:ok, {dq, dk, dv}}` (and `dbias` last with `dbias: true`).
  `deterministic: true` accumulates in a fixed order: the same bits on every run.
  """
  def attention_grad(q, k, v, o, lse, d_o, opts \\ []) do
    with {:ok, call} <- prepare(:bwd, [q, k, v, o, f32(lse), d_o], backward_opts(opts)) do
      dbias = if opts[:dbias] && tensor?(opts[:bias]), do: [{:f32, shape!(opts[:bias])}], else: []
      run(call, Enum.map([q, k, v], &{call.type, shape!(&1)}) ++ dbias)
    end
  end

  @doc """
  Packed variable-length batches: `q {Tq, Hq, D}`, `k, v {Tk, Hkv, D}`, sequence
  `b` owning rows `cu_q[b]..cu_q[b+1]-1` (`cu_q`, `cu_k`: lists of integers).
  `{:ok, {o, lse}}` with `lse {Hq, Tq}`. Options as `attention/4` (ALiBi only).
  """
  def attention_varlen(q, k, v, cu_q, cu_k, opts \\ []) do
    with {:ok, cu} <- cu_seqlens(cu_q, cu_k),
         {:ok, call} <- prepare(:fwd_varlen, [q, k, v | cu], opts ++ max_seqlen(cu_q, cu_k)) do
      run(call, [{call.type, shape!(q)}, {:f32, lse_shape(shape!(q))}])
    end
  end

  @doc "Gradients of `attention_varlen/6`: `{:ok, {dq, dk, dv}}`."
  def attention_varlen_grad(q, k, v, o, lse, d_o, cu_q, cu_k, opts \\ []) do
    with {:ok, cu} <- cu_seqlens(cu_q, cu_k),
         {:ok, call} <-
           prepare(:bwd_varlen, [q, k, v, o, f32(lse), d_o | cu], backward_opts(opts) ++ max_seqlen(cu_q, cu_k)) do
      run(call, Enum.map([q, k, v], &{call.type, shape!(&1)}))
    end
  end

  @doc """
  The attributes a call with `opts` passes (flashgen's attribute schema,
  `FlashGen.NIF.contract/0`), for head dim `d` and the extras named.
  """
  def attributes(opts, d, extras) do
    {left, right} = Keyword.get(opts, :window, {-1, -1})

    %{
      causal: Keyword.get(opts, :causal, false),
      scale: Keyword.get_lazy(opts, :scale, fn -> Target.default_scale(d) end),
      bottom_right: Keyword.get(opts, :bottom_right, false),
      window_left: left,
      window_right: right,
      softcap: Keyword.get(opts, :softcap, 0.0),
      extras: Enum.join(extras, ",")
    }
    |> Map.merge(Map.new(Keyword.take(opts, [:max_seqlen_q, :max_seqlen_k, :deterministic])))
  end

  # The backward calls' own attribute (default false).
  defp backward_opts(opts), do: Keyword.put_new(opts, :deterministic, false)

  defp prepare(direction, [q, k | _] = operands, opts) do
    type = Keyword.get(opts, :type, :f32)
    causal = Keyword.get(opts, :causal, false)

    with :ok <- check_type(type),
         :ok <- check_window(Keyword.get(opts, :window, {-1, -1})),
         :ok <- check_tensors(operands),
         d = q |> shape!() |> Tuple.to_list() |> List.last(),
         :ok <- check_kernel(d, causal),
         {:ok, opts} <- with_key_padding(opts, shape!(q), shape!(k)),
         {:ok, {names, extra_operands}} <- extras(opts) do
      {:ok,
       %{
         target: Target.name(direction, d, @types[type], causal),
         type: type,
         args: Enum.map(operands, &arg(&1, type)) ++ extra_operands,
         attrs: attributes(opts, d, names),
         threads: Keyword.get(opts, :threads, 1)
       }}
    end
  end

  # Results come back with their shapes.
  defp run(call, results) do
    with {:ok, data} <- NIF.call(call.target, call.args, results, call.attrs, call.threads) do
      {:ok, data |> Enum.zip(Enum.map(results, &elem(&1, 1))) |> List.to_tuple()}
    end
  end

  # lse is [B, Hq, Sq] for q [B, Sq, Hq, D] and [Hq, Tq] for packed q [Tq, Hq, D]; a q of
  # another rank gets a placeholder the kernel never reaches (it refuses q first).
  defp lse_shape({b, s, h, _}), do: {b, h, s}
  defp lse_shape({t, h, _}), do: {h, t}
  defp lse_shape(_), do: {0}

  defp f32({data, shape}), do: {data, shape, :f32}
  defp f32(other), do: other

  defp check_type(type) when is_map_key(@types, type), do: :ok
  defp check_type(type), do: {:error, "type must be one of #{inspect(Map.keys(@types))}, got #{inspect(type)}"}

  # The values are the kernel's to check (>= -1); the form is this module's.
  defp check_window({left, right}) when is_integer(left) and is_integer(right), do: :ok
  defp check_window(w), do: {:error, "window must be {left, right}, integers (-1 = unbounded), got #{inspect(w)}"}

  defp check_kernel(d, causal) do
    if d in Target.head_dims() and is_boolean(causal),
      do: :ok,
      else: {:error, "head dim #{inspect(d)}, causal #{inspect(causal)}: flashgen has kernels for head dims " <>
                       "#{inspect(Target.head_dims())}, causal true or false"}
  end

  defp check_tensors(operands) do
    case Enum.find(operands, &(not tensor?(&1))) do
      nil -> :ok
      bad -> {:error, "a tensor is {binary, shape} with a non-empty shape tuple, got #{inspect(bad, limit: 5)}"}
    end
  end

  defp tensor?({data, shape}) when is_binary(data) and is_tuple(shape) and tuple_size(shape) > 0, do: true
  defp tensor?({data, shape, type}) when is_atom(type), do: tensor?({data, shape})
  defp tensor?(_), do: false

  defp shape!({_, shape}), do: shape
  defp shape!({_, shape, _}), do: shape

  defp arg({data, shape}, type), do: {type, shape, data}
  defp arg({data, shape, own_type}, _), do: {own_type, shape, data}

  # The extras named in opts, in the library's order (FlashGen.NIF.contract/0), with their operands.
  defp extras(opts) do
    given =
      for {name, operands} <- contract_extras(),
          ops = Enum.map(operands, &String.to_atom/1),
          Enum.any?(ops, &Keyword.has_key?(opts, &1)),
          do: {name, ops}

    Enum.reduce_while(given, {:ok, {[], []}}, fn {name, ops}, {:ok, {names, args}} ->
      case Enum.find(ops, &(not tensor?(opts[&1]))) do
        nil -> {:cont, {:ok, {names ++ [name], args ++ Enum.map(ops, &arg(opts[&1], @operand_types[&1]))}}}
        op -> {:halt, {:error, "#{op} must be {binary, shape}, got #{inspect(opts[op], limit: 5)}"}}
      end
    end)
  end

  # The library's contract is fixed once it is loaded; read it once per VM.
  defp contract_extras do
    with nil <- :persistent_term.get({__MODULE__, :extras}, nil) do
      extras = NIF.contract().extras
      :persistent_term.put({__MODULE__, :extras}, extras)
      extras
    end
  end

  # key_lengths: [n_b] -> q ids 0, kv ids 0 for real keys and 1 for padding.
  defp with_key_padding(opts, q_shape, k_shape) do
    case {Keyword.pop(opts, :key_lengths), q_shape, k_shape} do
      {{nil, opts}, _, _} ->
        {:ok, opts}

      {{lengths, opts}, {b, sq, _, _}, {_, sk, _, _}} when is_list(lengths) and length(lengths) == b ->
        kv_ids = for n <- lengths, j <- 0..(sk - 1)//1, into: <<>>, do: <<if(j < n, do: 0, else: 1)::32-native>>
        {:ok, opts ++ [q_segment_ids: {:binary.copy(<<0::32-native>>, b * sq), {b, sq}}, kv_segment_ids: {kv_ids, {b, sk}}]}

      {{lengths, _}, _, _} ->
        {:error, "key_lengths must be a list of one integer per batch entry of q #{inspect(q_shape)}, got #{inspect(lengths, limit: 8)}"}
    end
  end

  defp cu_seqlens(cu_q, cu_k) do
    if Enum.all?([cu_q, cu_k], &int32_list?/1),
      do: {:ok, Enum.map([cu_q, cu_k], &{for(x <- &1, into: <<>>, do: <<x::32-signed-native>>), {length(&1)}, :i32})},
      else: {:error, "cu_seqlens_q and cu_seqlens_k must be lists of int32 integers, got #{inspect({cu_q, cu_k}, limit: 8)}"}
  end

  defp int32_list?(list), do: is_list(list) and Enum.all?(list, &(is_integer(&1) and &1 in -0x80000000..0x7FFFFFFF))

  defp max_seqlen(cu_q, cu_k) do
    longest = fn cu ->
      if int32_list?(cu),
        do: cu |> Enum.chunk_every(2, 1, :discard) |> Enum.map(fn [a, b] -> b - a end) |> Enum.max(fn -> 0 end),
        else: 0
    end

    [max_seqlen_q: longest.(cu_q), max_seqlen_k: longest.(cu_k)]
  end
end
