defmodule FlashGenNif.MixProject do
  use Mix.Project

  # No dependencies: runs with Debian's elixir (1.14) and erlang-dev alone. Target names and
  # the default scale come from the EXLA example's FlashGen.Attention.Target
  # (lib/flash_gen/attention/target.ex is a link to it).
  def project do
    [
      app: :flash_gen_nif,
      version: "0.1.0",
      elixir: "~> 1.14",
      elixirc_paths: if(Mix.env() == :test, do: ["lib", "test/support"], else: ["lib"]),
      deps: []
    ]
  end

  def application, do: [extra_applications: [:logger]]
end
