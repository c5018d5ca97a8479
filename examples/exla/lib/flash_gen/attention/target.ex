defmodule FlashGen.Attention.Target do
  @moduledoc """
  Names and attributes of flashgen's XLA FFI custom calls, as plain data.

  No Nx or EXLA here, so this module runs anywhere Elixir does (flashgen's
  Python test suite runs it with a bare `elixir` to compare it with what
  `flashgen emit` produces).

  * Target names: `flashgen_{fwd|bwd}_d{D}_{dtype}[_causal]`, e.g.
    `flashgen_fwd_d64_bf16_causal`. The same names on CPU ("Host") and CUDA.
  * Attributes: the handlers decode `causal : i1`, `scale : f32`,
    `bottom_right : i1`, `window_left : i32`, `window_right : i32` (sliding
    window, -1 = unbounded), `softcap : f32` (0 = off) and `extras` (a string
    naming optional extra operands; "" here: this example passes none) from the op's
    `backend_config` dictionary (the native, api_version 4 form). Every one must
    be present and the types must match exactly: an untyped float would be
    parsed as f64 and refused by the handler.

  `scale` is written as the hexadecimal bit pattern of the f32 (MLIR's exact
  float syntax, the one EXLA uses for its own constants), so no decimal rounding
  happens between Elixir and the kernel.

      iex> FlashGen.Attention.Target.name(:fwd, 64, {:bf, 16}, true)
      "flashgen_fwd_d64_bf16_causal"

      iex> FlashGen.Attention.Target.backend_config(true, 0.125, false)
      [{"causal", "true"}, {"scale", "0x3E000000 : f32"}, {"bottom_right", "false"},
       {"window_left", "-1 : i32"}, {"window_right", "-1 : i32"}, {"softcap", "0x00000000 : f32"},
       {"extras", "\"\""}]
  """

  @head_dims [32, 64, 96, 128, 160, 192, 224, 256]
  @dtypes %{{:f, 32} => "f32", {:f, 16} => "f16", {:bf, 16} => "bf16"}

  @doc "Head dims flashgen has kernels for."
  def head_dims, do: @head_dims

  @doc "flashgen's dtype name for an Nx type, or nil when flashgen has no kernel for it."
  def dtype(type), do: Map.get(@dtypes, type)

  @doc """
  The custom-call target for a direction (`:fwd`, `:bwd`; `:fwd_varlen`, `:bwd_varlen`,
  `:fwd_paged` for examples/elixir's NIF), head dim, Nx type and mask.
  """
  def name(direction, head_dim, type, causal)
      when direction in [:fwd, :bwd, :fwd_varlen, :bwd_varlen, :fwd_paged] and head_dim in @head_dims and
             is_boolean(causal) do
    dtype = dtype(type) || raise ArgumentError, "flashgen has no kernels for type #{inspect(type)}"
    "flashgen_#{direction}_d#{head_dim}_#{dtype}" <> if(causal, do: "_causal", else: "")
  end

  @doc """
  The `backend_config` entries, as the `{name, MLIR attribute}` pairs that
  `EXLA.CustomCall.Spec` takes in its `attributes` field.
  """
  def backend_config(causal, scale, bottom_right, window \\ {-1, -1}, softcap \\ 0.0)

  def backend_config(causal, scale, bottom_right, {left, right}, softcap)
      when is_boolean(causal) and is_number(scale) and scale > 0 and is_boolean(bottom_right) and
             is_integer(left) and left >= -1 and is_integer(right) and right >= -1 and
             is_number(softcap) and softcap >= 0 do
    [
      {"causal", to_string(causal)},
      {"scale", f32_literal(scale)},
      {"bottom_right", to_string(bottom_right)},
      {"window_left", "#{left} : i32"},
      {"window_right", "#{right} : i32"},
      {"softcap", f32_literal(softcap)},
      {"extras", ~s("")}
    ]
  end

  @doc "An MLIR f32 attribute holding `x` rounded to f32: `0x3E000000 : f32` for 0.125."
  def f32_literal(x) when is_number(x) do
    "0x" <> Base.encode16(<<x::float-32-big>>) <> " : f32"
  end

  @doc "The default softmax scale, 1/sqrt(head_dim)."
  def default_scale(head_dim), do: 1.0 / :math.sqrt(head_dim)
end
