# FLASHGEN_NIF_LIBRARY=priv/flashgen mix test    -- the library built with `flashgen build --for nif`
# FLASHGEN_ELIXIR_CASES=DIR                       -- also the cases tests/test_elixir_nif.py writes
library = System.get_env("FLASHGEN_NIF_LIBRARY")
if library, do: :ok = FlashGen.NIF.load(library)

ExUnit.start(
  exclude:
    if(library, do: [], else: [:nif]) ++ if(System.get_env("FLASHGEN_ELIXIR_CASES"), do: [], else: [:cases])
)
