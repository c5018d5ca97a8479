defmodule FlashGenExla.MixProject do
  use Mix.Project

  def project do
    [
      app: :flash_gen_exla,
      version: "0.1.0",
      elixir: "~> 1.15",
      start_permanent: Mix.env() == :prod,
      deps: deps()
    ]
  end

  def application do
    [extra_applications: [:logger]]
  end

  defp deps do
    [
      # EXLA >= 0.12 lowers Nx.block/4 tags through the EXLA.CustomCall protocol.
      {:exla, "~> 0.12"},
      {:nx, "~> 0.12"},
      # reads flashgen's manifest.json
      {:jason, "~> 1.4"}
    ]
  end
end
