"""flash_attention and emitted flashgen calls partitioned over batch and heads (8 CPU devices).

The multi-device tests need XLA_FLAGS=--xla_force_host_platform_device_count=8 before
JAX starts, which would disturb the other test modules, so under the normal test run
this file runs itself in a fresh interpreter (test_on_8_cpu_devices) and reports the
child's failures. To run the multi-device tests directly:

    FLASHGEN_MULTIDEVICE_CHILD=1 XLA_FLAGS=--xla_force_host_platform_device_count=8 \
        python3 -m pytest -q tests/test_sharding.py
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from conftest import MULTIDEVICE_CHILD as CHILD, run_multidevice_child as _run_child

D = 32


def _collectives(hlo: str) -> list[tuple[str, str]]:
    """(result shape, op) of every collective in compiled HLO text."""
    return re.findall(r"= (\([^()]*\)|\S+) (all-gather|all-to-all|collective-permute|all-reduce|"
                      r"reduce-scatter)(?:-start)?\(", hlo)


def _custom_call_shapes(hlo: str, target_prefix="flashgen_") -> list[list[str]]:
    """Operand shapes of every flashgen custom call in compiled HLO text."""
    out = []
    for line in hlo.splitlines():
        if "custom-call(" in line and f'custom_call_target="{target_prefix}' in line:
            out.append(re.findall(r"f32\[[\d,]*\]", line.split("operand_layout_constraints={")[1])
                       if "operand_layout_constraints" in line else [])
    return out


# ------------------------------------------------------------------------------------------
# Single-device tests (run in the normal test process).

if not CHILD:
    def test_on_8_cpu_devices():
        _run_child(__file__)

    def test_sharding_rule_attribute_on_emitted_calls_runs_on_one_device(rng):
        """The attribute names batch and heads parallel, the rest need-replication, and the
        emitted module still runs unchanged on one device."""
        from flashgen import KernelSpec, execute, reference
        from flashgen.emit import attention_module
        spec = KernelSpec(D, "f32", True, "cpu")
        for kv_heads, heads_dims in ((2, "kl"), (4, "k"), (1, "k")):
            text = str(attention_module(spec, batch=2, seq_q=16, seq_k=16, heads=4, kv_heads=kv_heads))
            rule = re.search(r"sdy.sharding_rule = (#sdy.op_sharding_rule<[^\n]*custom>)", text)
            assert rule, text
            assert "need_replication=" in rule.group(1) and rule.group(1).endswith("custom>")
            q, k, v = (rng.standard_normal(s).astype(np.float32)
                       for s in ((2, 16, 4, D), (2, 16, kv_heads, D), (2, 16, kv_heads, D)))
            o, lse = execute.run(text, [q, k, v])
            ref_o, ref_lse = reference.attention(q, k, v, causal=True)
            np.testing.assert_allclose(o, ref_o, rtol=2e-5, atol=2e-5)
            np.testing.assert_allclose(lse, ref_lse, rtol=2e-5, atol=2e-5)
        # GQA: q heads are the compound (kv head, group) factor; kv heads only the first.
        text = str(attention_module(spec, batch=2, seq_q=16, seq_k=8, heads=4, kv_heads=2))
        assert "([i, j, kl, m], [i, n, k, m], [i, n, k, m])->([i, j, kl, m], [i, kl, j])" in text
        assert "need_replication={j, l, m, n}" in text
        # Opting out, or a context without the sdy dialect, emits the plain call.
        from jaxlib.mlir import ir
        from jaxlib.mlir.dialects import func
        from flashgen.emit import emit_custom_call
        from flashgen.mlir_context import new_context
        with new_context(), ir.Location.unknown():
            module = ir.Module.create()
            t = ir.RankedTensorType.get([1, 8, 2, D], ir.F32Type.get())
            with ir.InsertionPoint(module.body):
                fn = func.FuncOp("main", ir.FunctionType.get([t, t, t], []))
                with ir.InsertionPoint(fn.add_entry_block()):
                    emit_custom_call(spec, "fwd", list(fn.arguments), scale=0.5, sharding_rule=False)
                    func.ReturnOp([])
            assert "sdy.sharding_rule" not in str(module)

    def test_fp8_forward_partitions_as_the_bf16_forward_with_descales_whole(monkeypatch):
        """The FP8 forward has no kernel on this machine (sm90a only), so its partitioning is
        checked on abstract shapes: flash_attention's call carries the Shardy rule (a unit factor
        per [1] descale), the XLA partitioner is registered for it and splits q, k, v by batch and
        heads exactly as the bf16 forward's, keeps the descales whole, and emits the per-device
        call with the FP8 types."""
        import jax
        import jax.numpy as jnp
        import ml_dtypes
        from jax._src.lib import xla_client as xc
        from flashgen import runtime
        from flashgen.contract import CallAttributes
        from flashgen.jax import attention, sharding
        monkeypatch.setattr(attention, "local_target", lambda: "sm90a")
        monkeypatch.setattr(runtime, "ensure", lambda specs: None)
        b, s, hq, hkv, d = 4, 32, 8, 4, 64
        q, kv = jnp.ones((b, s, hq, d), jnp.float8_e4m3fn), jnp.ones((b, s, hkv, d), jnp.float8_e4m3fn)
        text = jax.jit(lambda q, k: attention.flash_attention(q, k, k, causal=True, q_descale=0.5)).lower(
            q, kv).as_text()
        assert "([i, j, kl, m], [i, n, k, m], [i, n, k, m], [o], [p], [q])->([i, j, kl, m], [i, kl, j])" in text
        assert "need_replication={j, l, m, n}" in text

        def tiled(dims):
            op = xc.OpSharding()
            op.type = xc.OpSharding.Type.OTHER
            op.tile_assignment_dimensions, op.tile_assignment_devices = dims, list(range(8))
            return xc.HloSharding.from_proto(op)
        from flashgen.mlir_context import new_context
        with new_context():
            config = str(CallAttributes(True, 0.125).to_mlir("fwd")).encode()  # what XLA hands the partitioner
        q_sh = tiled([2, 1, 4, 1])  # batch over 2 devices, heads over 4
        rep = xc.HloSharding.replicate()

        def partition(name, dtype, out_dtype, descales):
            shape = lambda dims, t=dtype: xc.Shape.array_shape(np.dtype(t), dims)  # noqa: E731
            args = [shape((b, s, hq, d)), shape((b, s, hkv, d)), shape((b, s, hkv, d))]
            args += [shape((1,), np.float32)] * descales
            result = xc.Shape.tuple_shape([shape((b, s, hq, d), out_dtype), shape((b, hq, s), np.float32)])
            return sharding._partition(name, args, [q_sh] + [rep] * (len(args) - 1), result, None, config)

        assert "flashgen_fwd_d64_e4m3_causal" in sharding.all_target_names()
        module, operands, results = partition("flashgen_fwd_d64_e4m3_causal", ml_dtypes.float8_e4m3fn,
                                              ml_dtypes.bfloat16, 3)
        _, bf16_operands, bf16_results = partition("flashgen_fwd_d64_bf16_causal", ml_dtypes.bfloat16,
                                                   ml_dtypes.bfloat16, 0)
        assert operands[:3] == bf16_operands and results == bf16_results
        assert operands[0] == q_sh and operands[3:] == [rep] * 3
        assert operands[1] == q_sh  # kv heads follow the q heads
        local = module.decode()
        assert ("(tensor<2x32x2x64xf8E4M3FN>, tensor<2x32x1x64xf8E4M3FN>, tensor<2x32x1x64xf8E4M3FN>, "
                "tensor<1xf32>, tensor<1xf32>, tensor<1xf32>) -> (tensor<2x32x2x64xbf16>, tensor<2x2x32xf32>)") in local
        assert "@flashgen_fwd_d64_e4m3_causal(" in local

    def test_sharding_helper_refuses_splits_that_do_not_divide():
        import jax
        from flashgen.jax.sharding import attention_shardings
        mesh = jax.make_mesh((1,), ("model",))
        attention_shardings(mesh, (2, 8, 4, D), (2, 8, 2, D), heads="model")
        with pytest.raises(ValueError, match="no mesh axis 'data'"):
            attention_shardings(mesh, (2, 8, 4, D), (2, 8, 2, D), batch="data")


# ------------------------------------------------------------------------------------------
# Multi-device tests (the child process: 8 CPU devices).

if CHILD:
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    from flashgen import reference
    from flashgen.jax import export, flash_attention
    from flashgen.jax.sharding import attention_shardings

    assert jax.device_count() == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"

    B, S, HQ, HKV = 4, 32, 8, 4

    @pytest.fixture(scope="module")
    def mesh():
        return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)

    def _qkv(rng, b=B, s=S, hq=HQ, hkv=HKV):
        return [jnp.asarray(rng.standard_normal(x), jnp.float32)
                for x in ((b, s, hq, D), (b, s, hkv, D), (b, s, hkv, D))]

    def _loss(causal):
        def loss(q, k, v, w):
            o = flash_attention(q, k, v, causal=causal)
            return jnp.sum(o * w), o
        return jax.value_and_grad(loss, (0, 1, 2), has_aux=True)

    def _no_data_movement(hlo):
        """Only scalar all-reduces (the loss sum) may remain: q, k, v, o, lse never move."""
        scalar = lambda shape: all(dims == "" for dims in re.findall(r"\w+\[([\d,]*)\]", shape))
        moves = [c for c in _collectives(hlo) if not (c[1] == "all-reduce" and scalar(c[0]))]
        assert not moves, moves

    @pytest.mark.parametrize("causal", [False, True])
    def test_batch_and_heads_sharded_match_unsharded_without_collectives(rng, mesh, causal):
        q, k, v = _qkv(rng)
        w = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
        qs_, kvs_, _ = attention_shardings(mesh, q.shape, k.shape, batch="data", heads="model")
        args = [jax.device_put(q, qs_), jax.device_put(k, kvs_), jax.device_put(v, kvs_),
                jax.device_put(w, qs_)]
        step = jax.jit(_loss(causal))
        compiled = step.lower(*args).compile()
        hlo = compiled.as_text()
        _no_data_movement(hlo)
        # Per-device custom calls see the local shards: batch 4/2, heads 8/4 and 4/4.
        shapes = _custom_call_shapes(hlo)
        assert ["f32[2,32,2,32]", "f32[2,32,1,32]", "f32[2,32,1,32]"] in shapes, shapes
        assert any(s[:3] == ["f32[2,32,2,32]", "f32[2,32,1,32]", "f32[2,32,1,32]"] and
                   "f32[2,2,32]" in s for s in shapes), shapes  # the backward, with local lse
        (loss, o), grads = compiled(*args)
        (loss0, o0), grads0 = jax.jit(_loss(causal))(q, k, v, w)
        np.testing.assert_allclose(o, o0, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(loss, loss0, atol=1e-5 * float(jnp.abs(o0 * w).sum()))
        for g, g0 in zip(grads, grads0):
            np.testing.assert_allclose(g, g0, rtol=1e-5, atol=1e-5)
            assert g.sharding.spec == P("data", None, "model", None)
        assert o.sharding.spec == P("data", None, "model", None)
        # And against the float64 reference.
        ref = reference.attention(q, k, v, causal=causal, do=w)
        np.testing.assert_allclose(o, ref[0], rtol=2e-5, atol=2e-5)
        for g, r in zip(grads, ref[2]):
            np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)

    @pytest.mark.parametrize("bias_shape", [(B, HQ, S, S), (1, HQ, S, S), (B, 1, S, S)])
    def test_extras_follow_the_batch_and_head_split(rng, mesh, bias_shape):
        """Bias (+dbias), ALiBi slopes and segment ids are split like q: no collectives. (A bias
        broadcast over batch or heads keeps that dim whole in the backward, whose dbias sums
        over it: there the backward gathers, the forward still does not.)"""
        q, k, v = _qkv(rng)
        w = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
        bias = jnp.asarray(rng.standard_normal(bias_shape), jnp.float32)
        slopes = jnp.asarray(rng.uniform(0.1, 0.5, (HQ,)), jnp.float32)
        seg = jnp.asarray(np.sort(rng.integers(0, 3, (B, S)), axis=1), jnp.int32)

        def loss(q, k, v, w, bias, seg):
            o = flash_attention(q, k, v, bias, alibi_slopes=slopes, q_segment_ids=seg,
                                kv_segment_ids=seg, causal=True)
            return jnp.sum(o * w), o
        step = jax.value_and_grad(loss, (0, 1, 2, 4), has_aux=True)
        qs_, kvs_, _ = attention_shardings(mesh, q.shape, k.shape, batch="data", heads="model")
        bias_spec = P("data" if bias_shape[0] > 1 else None, "model" if bias_shape[1] > 1 else None)
        args = [jax.device_put(q, qs_), jax.device_put(k, kvs_), jax.device_put(v, kvs_),
                jax.device_put(w, qs_), jax.device_put(bias, NamedSharding(mesh, bias_spec)),
                jax.device_put(seg, NamedSharding(mesh, P("data")))]
        compiled = jax.jit(step).lower(*args).compile()
        hlo = compiled.as_text()
        if bias_shape[:2] == (B, HQ):
            _no_data_movement(hlo)
        fwd = jax.jit(lambda *a: loss(*a)[1]).lower(*args).compile().as_text()
        assert not _collectives(fwd), _collectives(fwd)
        (l, o), grads = compiled(*args)
        (l0, o0), grads0 = jax.jit(step)(q, k, v, w, bias, seg)
        np.testing.assert_allclose(o, o0, rtol=1e-6, atol=1e-6)
        for g, g0 in zip(grads, grads0):
            np.testing.assert_allclose(g, g0, rtol=1e-5, atol=1e-5)

    def test_varlen_splits_heads_and_paged_splits_batch_and_heads(rng, mesh):
        """Packed varlen calls run on local heads (tokens and cu_seqlens whole), paged calls
        on local batch and heads (caches split by kv head), ALiBi slopes split by head: no
        collectives, exact."""
        from flashgen.jax import flash_attention_paged, flash_attention_varlen
        t = 64
        q, k, v = (jnp.asarray(rng.standard_normal((t, h, D)), jnp.float32) for h in (HQ, HKV, HKV))
        cu = jnp.asarray([0, 20, 20, 64], jnp.int32)
        slopes = jnp.asarray(rng.uniform(0.05, 0.5, (HQ,)), jnp.float32)
        f = lambda q, k, v: flash_attention_varlen(q, k, v, cu, cu, 44, 44, causal=True,
                                                   alibi_slopes=slopes)
        step = jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(f(q, k, v) ** 2), (0, 1, 2)))
        hs = NamedSharding(mesh, P(None, "model", None))
        args = [jax.device_put(x, hs) for x in (q, k, v)]
        compiled = step.lower(*args).compile()
        _no_data_movement(compiled.as_text())
        (l, g), (l0, g0) = compiled(*args), step(q, k, v)
        np.testing.assert_allclose(l, l0, rtol=1e-6)
        for a, b in zip(g, g0):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
            assert a.sharding.spec == P(None, "model", None)

        nb, bs = 12, 16
        kc, vc = (jnp.asarray(rng.standard_normal((nb, bs, HKV, D)), jnp.float32) for _ in "kv")
        qp = jnp.asarray(rng.standard_normal((B, 1, HQ, D)), jnp.float32)
        table = jnp.asarray(rng.permutation(nb)[:B * 3].reshape(B, 3), jnp.int32)
        used = jnp.asarray([40, 3, 48, 0], jnp.int32)
        fp = jax.jit(lambda q, kc, vc, t, u: flash_attention_paged(q, kc, vc, t, u, causal=True,
                                                                   bottom_right=True,
                                                                   alibi_slopes=slopes))
        pargs = [jax.device_put(qp, NamedSharding(mesh, P("data", None, "model", None))),
                 jax.device_put(kc, NamedSharding(mesh, P(None, None, "model", None))),
                 jax.device_put(vc, NamedSharding(mesh, P(None, None, "model", None))),
                 jax.device_put(table, NamedSharding(mesh, P("data"))),
                 jax.device_put(used, NamedSharding(mesh, P("data")))]
        compiled = fp.lower(*pargs).compile()
        assert not _collectives(compiled.as_text()), _collectives(compiled.as_text())
        np.testing.assert_allclose(compiled(*pargs), fp(qp, kc, vc, table, used), rtol=1e-6, atol=1e-6)

    def test_gspmd_partitioner_splits_the_same_way(rng, mesh):
        q, k, v = _qkv(rng)
        w = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
        sh = NamedSharding(mesh, P("data", None, "model", None))
        args = [jax.device_put(x, sh) for x in (q, k, v, w)]
        jax.config.update("jax_use_shardy_partitioner", False)
        try:
            compiled = jax.jit(_loss(True)).lower(*args).compile()
            hlo = compiled.as_text()
            (_, o), grads = compiled(*args)
        finally:
            jax.config.update("jax_use_shardy_partitioner", True)
        _no_data_movement(hlo)
        assert ["f32[2,32,2,32]", "f32[2,32,1,32]", "f32[2,32,1,32]"] in _custom_call_shapes(hlo)
        (_, o0), grads0 = jax.jit(_loss(True))(q, k, v, w)
        np.testing.assert_allclose(o, o0, rtol=1e-6, atol=1e-6)
        for g, g0 in zip(grads, grads0):
            np.testing.assert_allclose(g, g0, rtol=1e-5, atol=1e-5)

    def test_propagation_from_a_sharded_neighbour(rng, mesh):
        """Nothing annotated at the call: the head split reaches it from column-sharded
        projections (Megatron style) and leaves through the output; q, k, v, o never move."""
        x = jax.device_put(jnp.asarray(rng.standard_normal((B, S, 64)), jnp.float32),
                           NamedSharding(mesh, P("data")))
        ws = [jax.device_put(jnp.asarray(rng.standard_normal((64, h * D)) / 8, jnp.float32),
                             NamedSharding(mesh, P(None, "model"))) for h in (HQ, HKV, HKV)]

        def loss(x, wq, wk, wv):
            q = (x @ wq).reshape(B, S, HQ, D)
            k = (x @ wk).reshape(B, S, HKV, D)
            v = (x @ wv).reshape(B, S, HKV, D)
            return jnp.sum(flash_attention(q, k, v, causal=True) ** 2)

        step = jax.jit(jax.value_and_grad(loss, (1, 2, 3)))
        hlo = step.lower(x, *ws).compile().as_text()
        assert ["f32[2,32,2,32]", "f32[2,32,1,32]", "f32[2,32,1,32]"] in _custom_call_shapes(hlo)
        for shape, op in _collectives(hlo):
            assert op == "all-reduce", (shape, op)  # weight gradients sum over data; nothing else
        val, grads = step(x, *ws)
        val0, grads0 = jax.jit(jax.value_and_grad(loss, (1, 2, 3)))(*(jax.device_get(a) for a in (x, *ws)))
        np.testing.assert_allclose(val, val0, rtol=1e-5)
        for a, b in zip(grads, grads0):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)

    def test_explicit_sharding_types_flow_through(rng):
        mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
        q, k, v = _qkv(rng)
        sh = NamedSharding(mesh, P("data", None, "model", None))
        qs, ks, vs = (jax.device_put(x, sh) for x in (q, k, v))
        with jax.set_mesh(mesh):
            def loss(q, k, v):
                o = flash_attention(q, k, v)
                assert jax.typeof(o).sharding.spec == P("data", None, "model", None)
                return jnp.sum(o ** 2)
            step = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))
            _no_data_movement(step.lower(qs, ks, vs).compile().as_text())
            val, grads = step(qs, ks, vs)
            eager = flash_attention(qs, ks, vs)
        val0, grads0 = jax.value_and_grad(lambda q, k, v: jnp.sum(flash_attention(q, k, v) ** 2),
                                          (0, 1, 2))(q, k, v)
        np.testing.assert_allclose(val, val0, rtol=1e-5)
        for g, g0 in zip(grads, grads0):
            np.testing.assert_allclose(g, g0, rtol=1e-5, atol=1e-5)
        assert eager.sharding.spec == P("data", None, "model", None)
        np.testing.assert_allclose(eager, flash_attention(q, k, v), rtol=1e-6, atol=1e-6)

    @pytest.mark.parametrize("hkv", [2, 1])
    def test_kv_heads_that_cannot_follow_the_head_split_are_still_exact(rng, mesh, hkv):
        """Hkv=2 (GQA) or 1 (MQA) cannot split 4 ways: kv stays whole on the model axis and the
        partitioner regroups q heads as needed, never giving a wrong answer."""
        q, k, v = _qkv(rng, hkv=hkv)
        qs = jax.device_put(q, NamedSharding(mesh, P("data", None, "model")))
        ks, vs = (jax.device_put(x, NamedSharding(mesh, P("data"))) for x in (k, v))
        f = jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(flash_attention(q, k, v, causal=True) ** 2),
                                       (0, 1, 2)))
        val, grads = f(qs, ks, vs)
        ref = reference.attention(q, k, v, causal=True, do=2 * reference.attention(q, k, v, causal=True)[0])
        np.testing.assert_allclose(val, np.sum(ref[0] ** 2), rtol=1e-5)
        for g, r in zip(grads, ref[2]):
            np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)

    def test_exported_sharded_module_keeps_partitioning(rng, mesh):
        q, k, v = _qkv(rng)
        sh = NamedSharding(mesh, P("data", None, "model", None))
        qs, ks, vs = (jax.device_put(x, sh) for x in (q, k, v))
        fn = jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=True), out_shardings=sh)
        exp = export(fn, qs, ks, vs)
        assert exp.nr_devices == 8 and "sdy.sharding_rule" in exp.mlir_module()
        restored = jax.export.deserialize(exp.serialize())
        compiled = jax.jit(restored.call).lower(qs, ks, vs).compile()
        hlo = compiled.as_text()
        assert not _collectives(hlo), _collectives(hlo)
        assert ["f32[2,32,2,32]", "f32[2,32,1,32]", "f32[2,32,1,32]"] in _custom_call_shapes(hlo)
        np.testing.assert_allclose(compiled(qs, ks, vs), flash_attention(q, k, v, causal=True),
                                   rtol=1e-6, atol=1e-6)

    def _exported_around(module_text, in_avals_shardings, out_shardings, out_avals, targets):
        """An Exported calling a plain StableHLO module (as flashgen.execute does) with
        the given input and output shardings."""
        import dataclasses
        from flashgen.rewrite import modules

        def template(*args):
            return tuple(jnp.zeros(a.shape, a.dtype) for a in out_avals)

        args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s) for a, s in in_avals_shardings]
        tmpl = jax.export.export(jax.jit(template, out_shardings=out_shardings))(*args)
        loaded = modules.load(module_text)
        with loaded.context:
            art = modules.serialize_artifact(loaded.module, None)
        return dataclasses.replace(
            tmpl, mlir_module_serialized=art, module_kept_var_idx=tuple(range(len(args))),
            disabled_safety_checks=tuple(jax.export.DisabledSafetyCheck.custom_call(t) for t in targets))

    def test_emitted_module_with_sharded_inputs_partitions(rng, mesh):
        from flashgen import KernelSpec, runtime
        from flashgen.emit import attention_module
        spec = KernelSpec(D, "f32", True, "cpu")
        runtime.ensure([spec])
        q, k, v = _qkv(rng)
        qsh, kvsh, lsesh = attention_shardings(mesh, q.shape, k.shape, batch="data", heads="model")
        for legacy in (False, True):
            text = str(attention_module(spec, batch=B, seq_q=S, seq_k=S, heads=HQ, kv_heads=HKV,
                                        legacy_attrs=legacy))
            exp = _exported_around(text, [(q, qsh), (k, kvsh), (v, kvsh)], (qsh, lsesh),
                                   [jax.ShapeDtypeStruct(q.shape, q.dtype),
                                    jax.ShapeDtypeStruct((B, HQ, S), jnp.float32)],
                                   [spec.target_name("fwd")])
            args = [jax.device_put(q, qsh), jax.device_put(k, kvsh), jax.device_put(v, kvsh)]
            compiled = jax.jit(exp.call).lower(*args).compile()
            hlo = compiled.as_text()
            assert not _collectives(hlo), _collectives(hlo)
            assert ["f32[2,32,2,32]", "f32[2,32,1,32]", "f32[2,32,1,32]"] in _custom_call_shapes(hlo)
            o, lse = compiled(*args)
            ref_o, ref_lse = reference.attention(q, k, v, causal=True)
            np.testing.assert_allclose(o, ref_o, rtol=2e-5, atol=2e-5)
            np.testing.assert_allclose(lse, ref_lse, rtol=2e-5, atol=2e-5)

    def test_rewritten_sharded_export_keeps_partitioning(rng, mesh):
        """jax.nn attention exported sharded over 8 devices, rewritten to flashgen calls:
        the rewritten module still compiles to per-device calls without gathers."""
        import flashgen.rewrite as fr
        from flashgen import runtime
        q, k, v = _qkv(rng)
        sh = NamedSharding(mesh, P("data", None, "model", None))
        qs, ks, vs = (jax.device_put(x, sh) for x in (q, k, v))
        f = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
                    out_shardings=sh)
        result = fr.rewrite(jax.export.export(f)(qs, ks, vs).serialize())
        assert len(result.rewritten) == 1, [s.reason for s in result.rejected]
        runtime.ensure(result.specs)
        exp = jax.export.deserialize(bytearray(result.to_bytes()))
        assert "sdy.sharding_rule" in exp.mlir_module()
        compiled = jax.jit(exp.call).lower(qs, ks, vs).compile()
        hlo = compiled.as_text()
        assert not _collectives(hlo), _collectives(hlo)
        assert ["f32[2,32,2,32]", "f32[2,32,1,32]", "f32[2,32,1,32]"] in _custom_call_shapes(hlo)
        np.testing.assert_allclose(compiled(qs, ks, vs), reference.attention(q, k, v, causal=True)[0],
                                   rtol=2e-5, atol=2e-5)

    def test_inside_shard_map_with_replicated_kv(rng):
        """A manual region: queries split over the axis, k/v replicated. The kernel runs on
        local blocks; the gradients of the replicated k/v are summed over the axis."""
        mesh = jax.make_mesh((4,), ("seq",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
        q, k, v = _qkv(rng, b=2, s=64, hq=4, hkv=2)
        f = jax.shard_map(lambda q, k, v: flash_attention(q, k, v), mesh=mesh,
                          in_specs=(P(None, "seq"), P(), P()), out_specs=P(None, "seq"))
        val, grads = jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(f(q, k, v) ** 2), (0, 1, 2)))(q, k, v)
        o = reference.attention(q, k, v)[0]
        ref = reference.attention(q, k, v, do=2 * o)
        np.testing.assert_allclose(val, np.sum(o ** 2), rtol=1e-5)
        for g, r in zip(grads, ref[2]):
            np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)

    # -- bad input: clear errors, never a wrong answer ----------------------------------

    def test_head_dim_sharding_is_an_error(rng):
        q, k, v = _qkv(rng)
        explicit = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
        bad = NamedSharding(explicit, P("data", None, None, "model"))
        with jax.set_mesh(explicit):
            with pytest.raises(ValueError, match="sharded along head_dim"):
                jax.jit(flash_attention)(*(jax.device_put(x, bad) for x in (q, k, v)))
        auto = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
        committed = jax.device_put(q, NamedSharding(auto, P(None, None, None, "model")))
        with pytest.raises(ValueError, match="sharded along head_dim"):
            flash_attention(committed, k, v)  # eager call on a committed array

    def test_auto_sharded_head_dim_under_jit_is_gathered_not_wrong(rng, mesh):
        """What jit's automatic mode cannot show us at trace time, the partitioner handles:
        head_dim is a need-replication factor, so the call sees whole vectors."""
        q, k, v = _qkv(rng)
        bad = NamedSharding(mesh, P("data", None, None, "model"))
        f = jax.jit(lambda q, k, v: flash_attention(q, k, v), in_shardings=(bad,) * 3)
        np.testing.assert_allclose(f(q, k, v), flash_attention(q, k, v), rtol=1e-6, atol=1e-6)

    def test_explicit_sequence_or_mismatched_head_split_is_an_error(rng):
        explicit = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
        q, k, v = _qkv(rng)
        with jax.set_mesh(explicit):
            seq = NamedSharding(explicit, P(None, "model"))
            with pytest.raises(ValueError, match="ring_attention"):
                jax.jit(flash_attention)(*(jax.device_put(x, seq) for x in (q, k, v)))
            qsh = NamedSharding(explicit, P("data", None, "model"))
            kvsh = NamedSharding(explicit, P("data"))
            with pytest.raises(ValueError, match="kv heads must be split over the same mesh axes"):
                jax.jit(flash_attention)(jax.device_put(q, qsh), jax.device_put(k, kvsh),
                                         jax.device_put(v, kvsh))

    def test_splits_that_do_not_divide_are_errors(rng, mesh):
        with pytest.raises(ValueError, match="kv heads .2. over mesh axes .'model',. of total size 4"):
            attention_shardings(mesh, (4, 32, 8, D), (4, 32, 2, D), batch="data", heads="model")
        with pytest.raises(ValueError, match="batch .3. over mesh axes .'data',."):
            attention_shardings(mesh, (3, 32, 8, D), (3, 32, 8, D), batch="data")
        q, k, v = _qkv(rng, b=3)
        uneven = NamedSharding(mesh, P("data", None, "model"))
        with pytest.raises(ValueError, match="evenly divide"):  # JAX's own check on the inputs
            jax.jit(flash_attention, in_shardings=(uneven,) * 3)(q, k, v)
