defmodule FlashGen.Attention do
  @moduledoc """
  FlashAttention in `defn`, lowered by EXLA to flashgen's XLA FFI kernels.

      :ok = FlashGen.Attention.load!("priv/flashgen/manifest.json")

      defmodule MyModel do
        import Nx.Defn

        defn attend(q, k, v), do: FlashGen.Attention.attention(q, k, v, causal: true)

        defn grads(q, k, v) do
          grad({q, k, v}, fn {q, k, v} -> Nx.sum(attend(q, k, v) ** 2) end)
        end
      end

      EXLA.jit(&MyModel.attend/3).(q, k, v)   # forward kernel
      EXLA.jit(&MyModel.grads/3).(q, k, v)    # forward + backward kernels

  Tensors are BSHD: `q[B, Sq, Hq, D]`, `k, v[B, Sk, Hkv, D]`, `Hkv` dividing
  `Hq` (GQA/MQA); `Sq` may differ from `Sk`. Types `:f32`, `:f16`, `:bf16`;
  head dims 32, 64, 96, 128, 160, 192, 224, 256.

  ## How it lowers

  `%FlashGen.Attention{}` is an `Nx.block/4` tag. EXLA hands every block to the
  `EXLA.CustomCall` protocol; the implementation below returns an
  `EXLA.CustomCall.Spec` naming the flashgen target, with the typed attributes
  the handler decodes (`causal : i1`, `scale : f32`, `bottom_right : i1`,
  `window_left : i32`, `window_right : i32`, `softcap : f32`, `extras = ""`) in the
  `backend_config` dictionary. EXLA emits the native api_version 4 form, without
  layouts. For `attention(q, k, v, causal: true, scale: 0.125)` on f32 tensors of
  shape `{1, 8, 2, 32}` and its gradient with `do` = `%arg3` (printed here as
  MLIR prints it):

  ```mlir
  %0:2 = stablehlo.custom_call @flashgen_fwd_d32_f32_causal(%arg0, %arg1, %arg2) {api_version = 4 : i32, backend_config = {bottom_right = false, causal = true, extras = "", scale = 1.250000e-01 : f32, softcap = 0.000000e+00 : f32, window_left = -1 : i32, window_right = -1 : i32}} : (tensor<1x8x2x32xf32>, tensor<1x8x2x32xf32>, tensor<1x8x2x32xf32>) -> (tensor<1x8x2x32xf32>, tensor<1x2x8xf32>)
  %1:3 = stablehlo.custom_call @flashgen_bwd_d32_f32_causal(%arg0, %arg1, %arg2, %0#0, %0#1, %arg3) {api_version = 4 : i32, backend_config = {bottom_right = false, causal = true, deterministic = false, extras = "", scale = 1.250000e-01 : f32, softcap = 0.000000e+00 : f32, window_left = -1 : i32, window_right = -1 : i32}} : (tensor<1x8x2x32xf32>, tensor<1x8x2x32xf32>, tensor<1x8x2x32xf32>, tensor<1x8x2x32xf32>, tensor<1x2x8xf32>, tensor<1x8x2x32xf32>) -> (tensor<1x8x2x32xf32>, tensor<1x8x2x32xf32>, tensor<1x8x2x32xf32>)
  ```

  The forward returns `o` and the log-sum-exp `lse[B, Hq, Sq]` (f32); the
  backward takes `q, k, v, o, lse, do` and returns `dq, dk, dv`. `attention/4`
  wires the backward through `custom_grad`, so `Nx.Defn.grad` runs the
  backward kernel with the forward's saved `lse`.

  The protocol returns `:skip` -- and EXLA compiles the block's default
  callback, a plain Nx implementation (`FlashGen.Attention.Reference`) -- when no
  loaded library has the target for the client's platform, or for a type or
  head dim flashgen has no kernel for. The same callback is what
  `Nx.Defn.Evaluator` and other compilers run.
  """

  import Nx.Defn

  alias FlashGen.Attention.{Reference, Target}

  @typedoc "A block tag: which kernel (`:fwd`/`:bwd`) and its attributes."
  @type t :: %__MODULE__{
          direction: :fwd | :bwd,
          causal: boolean,
          scale: float,
          bottom_right: boolean
        }
  defstruct direction: :fwd, causal: false, scale: 1.0, bottom_right: false

  @loaded {__MODULE__, :loaded}

  ## Loading the kernels

  @doc """
  Loads a library built by `flashgen build --for exla` and remembers its targets.

  Takes the library's `manifest.json` (or the directory holding it). The library
  is `dlopen`ed into the BEAM with `RTLD_GLOBAL` by EXLA's loader, and its static
  `XLA_FFI_REGISTER_HANDLER` initializers register every handler with the XLA
  inside EXLA's NIF ("Host" for a CPU build, "CUDA" for sm80/sm90a). Load it
  before compiling anything that uses `attention/4`.
  """
  def load!(manifest_path) do
    manifest_path =
      if File.dir?(manifest_path), do: Path.join(manifest_path, "manifest.json"), else: manifest_path

    manifest = manifest_path |> File.read!() |> Jason.decode!()

    unless manifest["host"] == "exla" do
      raise ArgumentError,
            "#{manifest_path} describes a library built for #{inspect(manifest["host"])}; " <>
              "build one with `flashgen build --for exla`"
    end

    library = Path.join(Path.dirname(Path.expand(manifest_path)), manifest["flashgen_library"])
    :ok = dlopen!(library)

    platform = if manifest["target"] == "cpu", do: :host, else: :cuda

    targets =
      for spec <- manifest["specs"], {_direction, name} <- spec["targets"], into: MapSet.new() do
        {platform, name}
      end

    :persistent_term.put(@loaded, MapSet.union(loaded(), targets))
    :ok
  end

  @doc "Whether a loaded library registered `target` for `platform` (`:host` or `:cuda`)."
  def loaded?(platform, target), do: MapSet.member?(loaded(), {platform, target})

  defp loaded, do: :persistent_term.get(@loaded, MapSet.new())

  # EXLA 0.12 loads native libraries with EXLA.NIF.load_dylib/1 (dlopen with
  # RTLD_GLOBAL); later revisions add the public EXLA.load_dylib/1. Use whichever
  # this EXLA has; apply/3 keeps the compiler quiet about the other one.
  defp dlopen!(library) do
    Code.ensure_loaded(EXLA)

    result =
      if function_exported?(EXLA, :load_dylib, 1),
        do: apply(EXLA, :load_dylib, [library]),
        else: apply(EXLA.NIF, :load_dylib, [library])

    case result do
      :ok -> :ok
      other -> raise ArgumentError, "could not load #{library}: #{inspect(other)}"
    end
  end

  ## defn API

  @doc """
  Scaled dot-product attention, differentiable.

  ## Options

    * `:causal` - key `j` is visible to query `i` iff `j <= i + offset` (default `false`)
    * `:scale` - softmax scale (default `1/sqrt(head_dim)`)
    * `:bottom_right` - causal offset `Sk - Sq` instead of 0, FlashAttention-2's
      alignment for decoding with a KV cache (default `false`)

  A query row that sees no key gets `o = 0` and zero gradients.
  """
  defn attention(q, k, v, opts \\ []) do
    opts = keyword!(opts, causal: false, scale: nil, bottom_right: false)
    attention_with_grad(q, k, v, opts)
  end

  @doc "The forward pass only: `{o, lse}` (no gradient is defined through `lse`)."
  defn attention_with_lse(q, k, v, opts \\ []) do
    opts = keyword!(opts, causal: false, scale: nil, bottom_right: false)
    forward_block(q, k, v, opts)
  end

  deftransformp attention_with_grad(q, k, v, opts) do
    tag = tag!(q, k, v, opts)
    {o, lse} = forward(tag, q, k, v)

    Nx.Defn.Kernel.custom_grad(o, [q, k, v], fn g ->
      {dq, dk, dv} = backward(tag, q, k, v, o, lse, g)
      [dq, dk, dv]
    end)
  end

  deftransformp forward_block(q, k, v, opts) do
    q |> tag!(k, v, opts) |> forward(q, k, v)
  end

  defp forward(tag, q, k, v) do
    {b, sq, hq, _d} = Nx.shape(q)
    out = {Nx.template(Nx.shape(q), Nx.type(q)), Nx.template({b, hq, sq}, {:f, 32})}

    Nx.block(%{tag | direction: :fwd}, [q, k, v], out, fn tag, q, k, v ->
      Reference.forward(q, k, v, tag)
    end)
  end

  defp backward(tag, q, k, v, o, lse, g) do
    out =
      {Nx.template(Nx.shape(q), Nx.type(q)), Nx.template(Nx.shape(k), Nx.type(k)),
       Nx.template(Nx.shape(v), Nx.type(v))}

    # the kernel takes do in q's type and lse in f32, whatever the incoming gradient's type
    g = Nx.as_type(g, Nx.type(q))
    lse = Nx.as_type(lse, {:f, 32})

    Nx.block(%{tag | direction: :bwd}, [q, k, v, o, lse, g], out, fn tag, q, k, v, o, lse, g ->
      Reference.backward(q, k, v, o, lse, g, tag)
    end)
  end

  defp tag!(q, k, v, opts) do
    check!(q, k, v)
    {_, _, _, d} = Nx.shape(q)
    scale = opts[:scale] || Target.default_scale(d)

    unless is_number(scale) and scale > 0 do
      raise ArgumentError, "scale must be a positive number, got: #{inspect(scale)}"
    end

    %__MODULE__{
      causal: opts[:causal] == true,
      scale: scale * 1.0,
      bottom_right: opts[:bottom_right] == true
    }
  end

  defp check!(q, k, v) do
    for {name, t} <- [q: q, k: k, v: v], Nx.rank(t) != 4 do
      raise ArgumentError,
            "#{name} must be rank 4 [batch, seq, heads, head_dim], got shape #{inspect(Nx.shape(t))}"
    end

    {b, _sq, hq, d} = Nx.shape(q)
    {bk, _sk, hkv, dk} = Nx.shape(k)

    cond do
      Nx.shape(k) != Nx.shape(v) ->
        raise ArgumentError, "k and v shapes differ: #{inspect(Nx.shape(k))} vs #{inspect(Nx.shape(v))}"

      bk != b or dk != d ->
        raise ArgumentError,
              "k/v shape #{inspect(Nx.shape(k))} does not match q #{inspect(Nx.shape(q))} in batch or head_dim"

      hkv == 0 or rem(hq, hkv) != 0 ->
        raise ArgumentError, "kv heads (#{hkv}) must divide q heads (#{hq})"

      not (Nx.type(q) == Nx.type(k) and Nx.type(k) == Nx.type(v)) ->
        raise ArgumentError,
              "q, k, v must share one type, got #{inspect(Nx.type(q))}, #{inspect(Nx.type(k))}, #{inspect(Nx.type(v))}"

      true ->
        :ok
    end
  end

  @doc false
  # EXLA.CustomCall's answer for a block: the flashgen target when a loaded
  # library has it for this client's platform, else :skip (the Nx fallback).
  def custom_call(%__MODULE__{} = tag, [q | _], %{platform: platform})
      when platform in [:host, :cuda] do
    {_, _, _, d} = q.shape

    with true <- Target.dtype(q.type) != nil,
         true <- d in Target.head_dims(),
         target = Target.name(tag.direction, d, q.type, tag.causal),
         true <- loaded?(platform, target) do
      {:ok,
       %EXLA.CustomCall.Spec{
         call_target_name: target,
         attributes:
           Target.backend_config(tag.causal, tag.scale, tag.bottom_right) ++
             if(tag.direction == :bwd, do: [{"deterministic", "false"}], else: [])
       }}
    else
      _ -> :skip
    end
  end

  def custom_call(_tag, _args, _client), do: :skip
end

defimpl EXLA.CustomCall, for: FlashGen.Attention do
  # EXLA 0.12.0 calls call(block, out, args, client): the output template
  # (a tuple) before the input templates (a list). Some nx main revisions passed
  # the two the other way round; both are accepted.
  def call(tag, out, args, client) when is_tuple(out) and is_list(args),
    do: FlashGen.Attention.custom_call(tag, args, client)

  def call(tag, args, out, client) when is_list(args) and is_tuple(out),
    do: FlashGen.Attention.custom_call(tag, args, client)

  def call(_tag, _out, _args, _client), do: :skip
end
