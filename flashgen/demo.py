"""`flashgen demo`: build one spec for the local target, run it through JAX, check it."""
from __future__ import annotations

import sys
import time

import numpy as np

from flashgen import reference
from flashgen.build import resolve_target
from flashgen.errors import FlashgenError

# Error bands the demo (and the test-suite) accept, relative to max |reference|.
TOLERANCE = {"f32": 2e-5, "bf16": 2e-2, "f16": 3e-3}


def run(head_dim: int = 64, dtype: str = "bf16", causal: bool = False, target: str = "auto") -> int:
    import jax
    import jax.numpy as jnp

    from flashgen import targets
    from flashgen.jax import flash_attention
    from flashgen.jax.attention import local_target
    from flashgen.spec import KernelSpec, normalize_dtype

    dtype = normalize_dtype(dtype)
    target, why = resolve_target(target)
    KernelSpec(head_dim, dtype, causal, target)  # validate before any work
    row = targets.lookup(target)
    if row.on_host:  # takes effect only before JAX's first backend query (the CLI's case)
        jax.config.update("jax_platforms", row.jax_platforms[0])
    running = local_target()  # what flash_attention will build and run, whatever was asked
    if running != target:
        raise FlashgenError(f"demo --target {target} cannot run here: JAX runs on "
                            f"{jax.default_backend()} ({running} kernels); `flashgen build --target "
                            f"{target}` builds it, `flashgen check --target {target} --emulate` "
                            "checks it under the PTX emulator")
    print(f"flashgen demo: head_dim={head_dim} dtype={dtype} causal={causal} target={target} ({why})")
    rng = np.random.default_rng()
    b, sq, sk, hq, hkv = 2, 257, 257, 4, 2
    jdt = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}[dtype]
    q, k, v, do = (jnp.asarray(rng.standard_normal(s), jdt)
                   for s in ((b, sq, hq, head_dim), (b, sk, hkv, head_dim), (b, sk, hkv, head_dim),
                             (b, sq, hq, head_dim)))
    t0 = time.perf_counter()
    fn = jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=causal))
    o, vjp = jax.vjp(fn, q, k, v)
    grads = vjp(do)
    jax.block_until_ready(grads)
    print(f"build + compile + run: {time.perf_counter() - t0:.1f}s "
          f"(shapes q {tuple(q.shape)}, k/v {tuple(k.shape)})")
    ref_o, _, ref_grads = reference.attention(*(np.asarray(x, np.float64) for x in (q, k, v)),
                                              causal=causal, do=np.asarray(do, np.float64))
    ok = True
    for name, got, want in zip(("o", "dq", "dk", "dv"), (o, *grads), (ref_o, *ref_grads)):
        err = float(np.max(np.abs(np.asarray(got, np.float64) - want)) / max(np.max(np.abs(want)), 1e-30))
        good = err <= TOLERANCE[dtype] * (4 if name != "o" else 1)
        ok &= good
        print(f"  {name}: max relative error {err:.2e} ({'ok' if good else 'TOO LARGE'})")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(run())
