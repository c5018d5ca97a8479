"""Rewrite a jax.export'ed transformer block and run it with flashgen's CPU kernels.

    python examples/rewrite_python_api.py

1. export a small causal attention layer with jax.export (what a user ships),
2. flashgen.rewrite replaces its attention with a flashgen custom call,
3. flashgen.build builds the kernels the report names; runtime.load registers them,
4. the rewritten Exported deserializes and runs in JAX like the original.
"""
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import flashgen
from flashgen import runtime

B, T, H, D = 2, 16, 4, 64


def layer(x, wq, wk, wv):
    q, k, v = ((x @ w).reshape(B, T, H, D) for w in (wq, wk, wv))
    return jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(B, T, H * D)


args = [jax.ShapeDtypeStruct((B, T, H * D), jnp.float32)] + \
    [jax.ShapeDtypeStruct((H * D, H * D), jnp.float32)] * 3
exported = jax.export.export(jax.jit(layer), platforms=["cpu"])(*args)

result = flashgen.rewrite(bytes(exported.serialize()))
print(result.report().explain())

with tempfile.TemporaryDirectory() as out:
    lib = flashgen.build(result.specs, "cpu", out=out)
    runtime.load(lib.manifest_path)
    rewritten = jax.export.deserialize(bytearray(result.to_bytes()))
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(a.shape).astype(np.float32) * 0.1 for a in args]
    got, ref = rewritten.call(*inputs), exported.call(*inputs)
    print("max |rewritten - original| =", float(jnp.max(jnp.abs(got - ref))))
