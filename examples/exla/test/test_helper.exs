# FLASHGEN_EXLA_MANIFEST=path/to/manifest.json mix test  -- runs the kernel tests too
ExUnit.start(exclude: if(System.get_env("FLASHGEN_EXLA_MANIFEST"), do: [], else: [:kernels]))
