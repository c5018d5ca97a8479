"""ring_attention: sequence parallelism over 4 and 8 CPU devices, forward and gradients.

Like tests/test_sharding.py, the multi-device tests run in a fresh interpreter with
XLA_FLAGS=--xla_force_host_platform_device_count=8 (test_on_8_cpu_devices); run them
directly with

    FLASHGEN_MULTIDEVICE_CHILD=1 XLA_FLAGS=--xla_force_host_platform_device_count=8 \
        python3 -m pytest -q tests/test_ring.py
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from conftest import MULTIDEVICE_CHILD as CHILD, run_multidevice_child as _run_child

D = 32


def _ring_fn(mesh, axis, causal, **kw):
    import jax
    from jax.sharding import PartitionSpec as P
    from flashgen.jax import ring_attention
    spec = P(None, axis)
    return jax.shard_map(lambda q, k, v: ring_attention(q, k, v, axis_name=axis, causal=causal),
                         mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, **kw)


if not CHILD:
    def test_on_8_cpu_devices():
        _run_child(__file__)

    def test_ring_of_one_device_is_flash_attention(rng):
        import jax
        import jax.numpy as jnp
        from flashgen.jax import flash_attention
        mesh = jax.make_mesh((1,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,))
        q, k, v = (jnp.asarray(rng.standard_normal((2, 16, 4, D)), jnp.float32) for _ in range(3))
        for causal in (False, True):
            ring = _ring_fn(mesh, "seq", causal)
            np.testing.assert_allclose(jax.jit(ring)(q, k, v), flash_attention(q, k, v, causal=causal),
                                       rtol=1e-6, atol=1e-6)
            g = jax.grad(lambda q: jnp.sum(ring(q, k, v) ** 2))(q)
            g0 = jax.grad(lambda q: jnp.sum(flash_attention(q, k, v, causal=causal) ** 2))(q)
            np.testing.assert_allclose(g, g0, rtol=1e-5, atol=1e-5)

    def test_ring_outside_shard_map_is_a_clear_error():
        import jax.numpy as jnp
        from flashgen.jax import ring_attention
        q = jnp.ones((1, 8, 2, D))
        with pytest.raises(NameError, match="must run inside shard_map"):
            ring_attention(q, q, q, axis_name="seq")


if CHILD:
    import time

    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    from flashgen import reference
    from flashgen.jax import flash_attention, ring_attention

    assert jax.device_count() == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"

    def _mesh(n, name="seq"):
        return jax.make_mesh((n,), (name,), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])

    def _inputs(rng, b=2, sq=64, sk=64, hq=4, hkv=2):
        q = rng.standard_normal((b, sq, hq, D)).astype(np.float32)
        k = rng.standard_normal((b, sk, hkv, D)).astype(np.float32)
        v = rng.standard_normal((b, sk, hkv, D)).astype(np.float32)
        w = rng.standard_normal((b, sq, hq, D)).astype(np.float32)
        return q, k, v, w

    @pytest.mark.parametrize("n", [4, 8])
    @pytest.mark.parametrize("causal", [False, True])
    def test_ring_matches_single_device_forward_and_gradients(rng, n, causal):
        q, k, v, w = _inputs(rng)
        ring = _ring_fn(_mesh(n), "seq", causal)
        loss = lambda f: (lambda q, k, v: jnp.sum(f(q, k, v) * w))
        step = jax.jit(jax.value_and_grad(loss(ring), (0, 1, 2)))
        hlo = step.lower(q, k, v).compile().as_text()
        # Only K/V blocks (and their dk/dv accumulators) travel: collective-permutes of
        # [B, S/n, Hkv, D]; nothing is ever gathered.
        moves = re.findall(r"= (\([^()]*\)|\S+) (all-gather|all-to-all|collective-permute)(?:-start)?\(", hlo)
        block = f"f32[2,{64 // n},2,32]"
        assert moves and all(op == "collective-permute" and
                             set(re.findall(r"\w+\[[\d,]*\]", shape)) == {block}
                             for shape, op in moves), moves
        o = jax.jit(ring)(q, k, v)
        val, grads = step(q, k, v)
        o_single = flash_attention(q, k, v, causal=causal)
        g_single = jax.grad(loss(lambda q, k, v: flash_attention(q, k, v, causal=causal)), (0, 1, 2))(q, k, v)
        np.testing.assert_allclose(o, o_single, rtol=1e-5, atol=1e-5)
        for g, g0 in zip(grads, g_single):
            np.testing.assert_allclose(g, g0, rtol=1e-5, atol=1e-5)
        ref_o, _, ref_g = reference.attention(q, k, v, causal=causal, do=w)
        np.testing.assert_allclose(o, ref_o, rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(val, np.sum(ref_o * w), atol=1e-5 * np.abs(ref_o * w).sum())
        for g, r in zip(grads, ref_g):
            np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)

    @pytest.mark.parametrize("n, w", [(4, 16), (4, 5), (8, 8), (8, 0)])
    def test_causal_sliding_window_is_one_hop(rng, n, w):
        """causal + window (w <= block): one kernel call on [K_{i-1}; K_i], dk/dv one hop back."""
        from jax.sharding import PartitionSpec as P
        q, k, v, x = _inputs(rng)
        mesh, spec = _mesh(n), P(None, "seq")
        ring = jax.shard_map(lambda q, k, v: ring_attention(q, k, v, axis_name="seq", causal=True,
                                                            window=(w, -1)),
                             mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
        loss = lambda f: (lambda q, k, v: jnp.sum(f(q, k, v) * x))
        step = jax.jit(jax.value_and_grad(loss(ring), (0, 1, 2)))
        moves = re.findall(r"= (\([^()]*\)|\S+) (all-gather|all-to-all|collective-permute)(?:-start)?\(",
                           step.lower(q, k, v).compile().as_text())
        assert moves and all(op == "collective-permute" for _, op in moves), moves
        val, grads = step(q, k, v)
        ref_o, _, ref_g = reference.attention(q, k, v, causal=True, window=(w, -1), do=x)
        np.testing.assert_allclose(jax.jit(ring)(q, k, v), ref_o, rtol=2e-5, atol=2e-5)
        for g, r in zip(grads, ref_g):
            np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)

    def test_ring_window_limits_are_errors(rng):
        q, k, v, _ = _inputs(rng)
        for kw in (dict(causal=False, window=(4, 4)), dict(causal=True, window=(17, -1)),
                   dict(causal=True, window=(4, 3))):
            with pytest.raises(ValueError, match="sliding window only with causal"):
                jax.shard_map(lambda q, k, v: ring_attention(q, k, v, axis_name="seq", **kw),
                              mesh=_mesh(4), in_specs=(P(None, "seq"),) * 3,
                              out_specs=P(None, "seq"))(q, k, v)

    def test_ring_cross_attention_with_more_keys_than_queries(rng):
        q, k, v, w = _inputs(rng, sq=32, sk=64, hq=4, hkv=1)
        ring = _ring_fn(_mesh(4), "seq", False)
        o, grads = jax.jit(lambda q, k, v: jax.value_and_grad(
            lambda q, k, v: jnp.sum(ring(q, k, v) * w), (0, 1, 2))(q, k, v))(q, k, v)
        ref_o, _, ref_g = reference.attention(q, k, v, do=w)
        np.testing.assert_allclose(o, np.sum(ref_o * w), atol=1e-5 * np.abs(ref_o * w).sum())
        for g, r in zip(grads, ref_g):
            np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)

    def test_ring_composes_with_batch_sharding_on_another_axis(rng):
        """mesh data=2 × seq=4: shard_map is manual over seq only; batch stays split over data
        by the partitioner (per-device calls see batch 1 and a quarter of the sequence)."""
        mesh = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(AxisType.Auto,) * 2)
        q, k, v, w = _inputs(rng)
        sh = NamedSharding(mesh, P("data", "seq"))
        args = [jax.device_put(x, sh) for x in (q, k, v)]
        ring = _ring_fn(mesh, "seq", True, axis_names={"seq"})
        step = jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(ring(q, k, v) * w), (0, 1, 2)))
        hlo = step.lower(*args).compile().as_text()
        assert "f32[1,16,4,32]" in hlo and not re.search(r"all-gather|all-to-all", hlo)
        val, grads = step(*args)
        ref_o, _, ref_g = reference.attention(q, k, v, causal=True, do=w)
        np.testing.assert_allclose(val, np.sum(ref_o * w), atol=1e-5 * np.abs(ref_o * w).sum())
        for g, r in zip(grads, ref_g):
            np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)

    def test_ring_on_an_explicit_mesh(rng):
        mesh = jax.make_mesh((4,), ("seq",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:4])
        q, k, v, w = _inputs(rng)
        sh = NamedSharding(mesh, P(None, "seq"))
        args = [jax.device_put(x, sh) for x in (q, k, v)]
        with jax.set_mesh(mesh):
            ring = jax.shard_map(lambda q, k, v: ring_attention(q, k, v, axis_name="seq", causal=True),
                                 in_specs=(P(None, "seq"),) * 3, out_specs=P(None, "seq"))
            o = jax.jit(ring)(*args)
        assert o.sharding.spec == P(None, "seq", None, None)
        np.testing.assert_allclose(o, reference.attention(q, k, v, causal=True)[0], rtol=2e-5, atol=2e-5)

    # Long sequences: the [S, S] scores of one head would need 16 GiB; ring attention
    # runs in a few MiB per device.
    LONG_SEQ = 65536
    BUDGET = 256 * 2 ** 20  # bytes per device

    def test_long_sequence_beyond_memory_budget(rng):
        n = 8
        mesh = _mesh(n)
        scores_bytes = LONG_SEQ * LONG_SEQ * 4
        assert scores_bytes >= 64 * BUDGET  # 16 GiB of f32 scores for one head vs 256 MiB
        shape = (1, LONG_SEQ, 1, D)
        sharded = NamedSharding(mesh, P(None, "seq"))
        ring = jax.jit(_ring_fn(mesh, "seq", True))
        abstract = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharded)
        compiled = ring.lower(abstract, abstract, abstract).compile()
        mem = compiled.memory_analysis()
        per_device = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
        assert per_device < BUDGET // 16, mem
        # Plain XLA attention of the same length materializes the scores (checked at compile
        # time only; it would not run in the budget).
        plain = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                     implementation="xla"))
        one = jax.ShapeDtypeStruct(shape, jnp.float32)
        assert plain.lower(one, one, one).compile().memory_analysis().temp_size_in_bytes > BUDGET
        q, k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(3))
        t0 = time.perf_counter()
        o = np.asarray(compiled(*(jax.device_put(x, sharded) for x in (q, k, v))))
        seconds = time.perf_counter() - t0
        # Exact float64 check on sampled query rows (each row needs only its own keys).
        rows = np.concatenate([[0, 1, LONG_SEQ - 1], rng.choice(LONG_SEQ, 29, replace=False)])
        for r in rows:
            s = (k[0, : r + 1, 0].astype(np.float64) @ q[0, r, 0].astype(np.float64)) / np.sqrt(D)
            p = np.exp(s - s.max())
            expected = (p / p.sum()) @ v[0, : r + 1, 0].astype(np.float64)
            np.testing.assert_allclose(o[0, r, 0], expected, rtol=1e-4, atol=1e-4)
        print(f"ring attention S={LONG_SEQ} over {n} devices: {per_device / 2**20:.1f} MiB per device, "
              f"{seconds:.2f} s (one head's scores: {scores_bytes / 2**30:.0f} GiB)")

    # -- bad input --------------------------------------------------------------------

    def test_sequence_not_divisible_by_the_axis_is_an_error(rng):
        q = jnp.ones((1, 60, 2, D))
        with pytest.raises(ValueError, match="not evenly divisible"):
            jax.jit(_ring_fn(_mesh(8), "seq", False))(q, q, q)

    def test_causal_ring_needs_equal_blocks():
        q, kv = jnp.ones((1, 32, 2, D)), jnp.ones((1, 64, 2, D))
        with pytest.raises(ValueError, match="equal query and key blocks"):
            jax.jit(_ring_fn(_mesh(4), "seq", True))(q, kv, kv)

    def test_head_dim_still_checked_inside_the_ring():
        q = jnp.ones((1, 32, 2, 300))
        with pytest.raises(ValueError, match="unsupported head_dim 300"):
            jax.jit(_ring_fn(_mesh(4), "seq", False))(q, q, q)
