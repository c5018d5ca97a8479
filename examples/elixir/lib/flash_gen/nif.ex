defmodule FlashGen.NIF do
  @moduledoc """
  The erl_nif face of a library built with `flashgen build --for nif`
  (csrc/flashgen/nif_face.h): flashgen's CPU kernels, called through their own
  XLA FFI handlers, so the checks and the call contract are the ones XLA sees.

  Scheduling: a dense call whose work (B·Sq·Sk·Hq·D, twice that backward) is at
  most `contract().inline_work` -- about 100 µs of kernel, S = 64, H = 4, D = 64
  forward -- runs on the caller's normal scheduler (no switch); every other
  call moves to a dirty CPU scheduler, so a long call never blocks the normal
  schedulers. Every argument is checked in C first; bad input comes back as
  `{:error, message}`.

  Load once per VM with `load/1` (the library path, with or without `.so`, or
  its directory: the `manifest.json` there names the file).
  """

  @doc "Loads the NIF library; `:ok` or `{:error, message}`."
  def load(path) do
    path = Path.expand(path)

    with {:ok, library} <- library_path(path) do
      case :erlang.load_nif(String.to_charlist(Path.rootname(library, ".so")), 0) do
        :ok -> :ok
        {:error, {:reload, _}} -> :ok
        {:error, {reason, text}} -> {:error, "cannot load #{library}: #{reason}: #{text}"}
      end
    end
  end

  # A directory holds manifest.json, which names the library file (its host must be "nif").
  defp library_path(path) do
    if File.dir?(path) do
      manifest = File.read!(Path.join(path, "manifest.json"))

      case Regex.run(~r/"flashgen_library":\s*"([^"]+)"/, manifest) do
        [_, name] ->
          if manifest =~ ~r/"host":\s*"nif"/,
            do: {:ok, Path.join(path, name)},
            else: {:error, "#{path} holds no library built with `flashgen build --for nif`"}

        nil ->
          {:error, "#{path}/manifest.json names no flashgen library"}
      end
    else
      {:ok, path}
    end
  end

  @doc """
  Calls `target` on `args` (`[{type, shape, binary}]`), allocating `results`
  (`[{type, shape}]`), with exactly the target's attributes (`%{atom => value}`);
  `{:ok, [binary]}` or `{:error, message}`. Types: `:f32`, `:bf16`, `:f16`, `:i32`, `:pred`.
  The kernels run inline on the scheduler thread that runs the call.
  """
  def call(_target, _args, _results, _attrs), do: :erlang.nif_error(:flashgen_nif_not_loaded)

  @doc "`call/4` with `threads`: 1 runs the kernels inline, 0 on one worker per CPU."
  def call(_target, _args, _results, _attrs, _threads), do: :erlang.nif_error(:flashgen_nif_not_loaded)

  @doc """
  Runs the call `n` times from C on one decoded argument set: `{:ok, [nanoseconds]}`,
  the kernel's own time without the NIF boundary (for the latency benchmark).
  """
  def time_in_c(_target, _args, _results, _attrs, _n), do: :erlang.nif_error(:flashgen_nif_not_loaded)

  @doc "The target names (custom-call targets and C symbols) this library has."
  def targets, do: :erlang.nif_error(:flashgen_nif_not_loaded)

  @doc "The library's JSON description: specs, attributes, target."
  def info, do: :erlang.nif_error(:flashgen_nif_not_loaded)

  @doc """
  The call contract the library was built with (flashgen.spec):
  `%{attributes: %{direction => [{name, type}]}, extras: [{name, [operand]}], inline_work: n}`
  (`inline_work`: the most work a call runs on a normal scheduler).
  """
  def contract, do: :erlang.nif_error(:flashgen_nif_not_loaded)
end
