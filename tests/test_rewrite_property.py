"""Property: whatever the rewriter replaces still computes the same outputs.

Hypothesis builds random attention-like programs with jax (layouts, scale spellings,
masks, softmax spellings and axes, GQA, extra users of intermediates), exports them,
rewrites them and runs original and rewritten module on the same inputs. Programs that
are attention must be rewritten; near misses (wrong softmax axis, intermediates used
elsewhere) must be left alone. Masks and biases that are no causal/window band become
extra operands (README "Variants"): constant masks, ALiBi, run-time biases and masks.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flashgen.rewrite as fr
from flashgen import execute
from flashgen.rewrite import modules

B, H, D = 2, 4, 32

programs = st.fixed_dictionaries({
    "layout": st.sampled_from(["BSHD", "BHSD", "folded"]),
    "scale": st.sampled_from(["mul", "div_sqrt", "q", "split", "none"]),
    "mask": st.sampled_from(["none", "where", "bias", "const", "bottom_right", "window",
                             "random", "alibi", "rt_bias", "rt_mask"]),
    "fill": st.sampled_from([-np.inf, -1e9, "min"]),
    "softmax": st.sampled_from(["jax", "manual", "unstable", "recip"]),
    "axis": st.sampled_from(["keys", "keys", "keys", "queries"]),
    "extra": st.sampled_from([None, None, None, "probs", "scores", "exp"]),
    "v_left": st.booleans(),
    "gqa": st.booleans(),
    "dtype": st.sampled_from(["float32", "float32", "bfloat16"]),
    "seq_k": st.sampled_from([8, 16]),
})


def seq_k(p) -> int:
    if p["mask"] in ("where", "bias", "const", "window") or p["layout"] == "folded":
        return 8  # square masks; folded heads keep one head axis for K/V
    return p["seq_k"]


def build(p):
    t, s = 8, seq_k(p)
    hkv = H // 2 if p["gqa"] and p["layout"] != "folded" else H
    dt = jnp.dtype(p["dtype"])
    fill = jnp.finfo(jnp.float32).min if p["fill"] == "min" else p["fill"]
    rng = np.random.default_rng(0)
    random_mask = rng.random((t, s)) < 0.7
    random_mask[:, 0] = True
    slopes = np.array([2.0 ** (-8.0 * (n + 1) / H) for n in range(H)], np.float32)
    if p["layout"] == "folded":
        slopes = np.tile(slopes, B)

    def attention(q, k, v, *extra_args):
        # q, k, v in BSHD (or [B*H, S, D] folded); compute scores as [..., q, k]
        if p["layout"] == "folded":
            qs, ks, vs = q, k, v
            sub_q, sub_k = "xqd", "xkd"
            pre = "x"
        else:
            if hkv != H:
                k = jnp.repeat(k, H // hkv, axis=2)
                v = jnp.repeat(v, H // hkv, axis=2)
            if p["layout"] == "BHSD":
                q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
                sub_q, sub_k, pre = "bhqd", "bhkd", "bh"
            else:
                sub_q, sub_k, pre = "bqhd", "bkhd", "bh"
            qs, ks, vs = q, k, v
        c = 1 / math.sqrt(D)
        if p["scale"] == "q":
            qs = qs * jnp.asarray(c, qs.dtype)
        elif p["scale"] == "split":
            qs, ks = qs * jnp.asarray(math.sqrt(c), qs.dtype), ks * jnp.asarray(math.sqrt(c), ks.dtype)
        sc = jnp.einsum(f"{sub_q},{sub_k}->{pre}qk", qs, ks, preferred_element_type=jnp.float32)
        if p["scale"] == "mul":
            sc = sc * c
        elif p["scale"] == "div_sqrt":
            sc = sc / jnp.sqrt(jnp.float32(D))
        i, j = jnp.arange(t)[:, None], jnp.arange(s)[None, :]
        if p["mask"] == "where":
            sc = jnp.where(j <= i, sc, fill)
        elif p["mask"] == "bias":
            sc = sc + jnp.where(j <= i, 0.0, -jnp.inf)
        elif p["mask"] == "const":
            sc = jnp.where(np.tril(np.ones((t, s), bool)), sc, fill)
        elif p["mask"] == "bottom_right":
            sc = jnp.where(j <= i + (s - t), sc, fill)
        elif p["mask"] == "window":
            sc = jnp.where((j <= i) & (j > i - 3), sc, fill)
        elif p["mask"] == "random":
            sc = jnp.where(random_mask, sc, fill)
        elif p["mask"] == "alibi":
            dist = jnp.abs(i - j).astype(jnp.float32)
            sc = sc - (slopes[:, None, None] if p["layout"] == "folded"
                       else slopes[None, :, None, None]) * dist
        elif p["mask"] == "rt_bias":
            sc = sc + extra_args[0]
        elif p["mask"] == "rt_mask":
            sc = jnp.where(extra_args[0], sc, fill)
        ax = -1 if p["axis"] == "keys" else -2
        extra = None
        if p["softmax"] == "jax":
            pr = jax.nn.softmax(sc, axis=ax)
        else:
            m = jnp.max(sc, axis=ax, keepdims=True)
            e = jnp.exp(sc) if p["softmax"] == "unstable" else jnp.exp(sc - m)
            den = jnp.sum(e, axis=ax, keepdims=True)
            pr = e * (1 / den) if p["softmax"] == "recip" else e / den
            if p["extra"] == "exp":
                extra = e
        if p["extra"] == "probs":
            extra = pr
        elif p["extra"] == "scores":
            extra = sc
        pr = pr.astype(dt)
        if p["layout"] == "folded":
            out = jnp.einsum("xqk,xkd->xqd", pr, vs) if not p["v_left"] else \
                jnp.einsum("xkd,xqk->xqd", vs, pr)
        else:
            out = jnp.einsum(f"{pre}qk,{sub_k}->{sub_q}", pr, vs) if not p["v_left"] else \
                jnp.einsum(f"{sub_k},{pre}qk->{sub_q}", vs, pr)
            if p["layout"] == "BHSD":
                out = jnp.swapaxes(out, 1, 2)
        return out if extra is None else (out, jnp.sum(extra))

    if p["layout"] == "folded":
        shapes = [(B * H, t, D), (B * H, s, D), (B * H, s, D)]
    else:
        shapes = [(B, t, H, D), (B, s, hkv, D), (B, s, hkv, D)]
    args = [jax.ShapeDtypeStruct(x, dt) for x in shapes]
    lead = (B * H,) if p["layout"] == "folded" else (B, H if p["mask"] == "rt_bias" else 1)
    if p["mask"] == "rt_bias":
        args.append(jax.ShapeDtypeStruct(lead + (t, s), dt))
    elif p["mask"] == "rt_mask":
        args.append(jax.ShapeDtypeStruct(lead + (t, s), jnp.bool_))
    return jax.export.export(jax.jit(attention), platforms=["cpu"])(*args).mlir_module()


def is_attention(p) -> bool:
    extra = p["extra"] if not (p["extra"] == "exp" and p["softmax"] == "jax") else None
    return p["axis"] == "keys" and extra is None


EXTRAS = {"random": ["mask"], "alibi": ["alibi"], "rt_bias": ["bias"], "rt_mask": ["mask"]}
BANDS = ("where", "bias", "const", "bottom_right", "window")


@pytest.fixture(scope="module")
def kernels():
    from flashgen import runtime
    from flashgen.spec import KernelSpec
    runtime.ensure([KernelSpec(D, dt, c, "cpu") for dt in ("f32", "bf16") for c in (False, True)])


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(p=programs)
def test_rewritten_programs_compute_the_same(p, kernels):
    text = build(p)
    result = fr.rewrite(text)
    if is_attention(p):
        assert len(result.rewritten) == 1, (p, [s.reason for s in result.rejected])
        site = result.rewritten[0]
        assert site.causal == (p["mask"] in BANDS)
        assert site.extras == EXTRAS.get(p["mask"], []), site.extras_detail
        if p["mask"] == "bottom_right":
            assert site.bottom_right == (seq_k(p) != 8)
        assert list(site.window) == ([2, -1] if p["mask"] == "window" else [-1, -1])
    else:
        assert not result.rewritten, (p, result.rewritten)
        assert result.to_bytes() == text.encode()
        return
    original, rewritten = modules.load(text), modules.load(result.to_bytes())
    params, _ = execute.signature(original)
    inputs = execute.random_inputs(params, seed=7)
    for x in inputs:
        if x.dtype == np.bool_:
            x[..., 0] = True  # a row that sees no key: the kernel gives 0 by design
    ref = execute.run(original, inputs, register=False)
    got = execute.run(rewritten, inputs)
    dtype = "bf16" if p["dtype"] == "bfloat16" else "f32"
    rows = execute.compare(ref, got, dtype)
    assert all(r["ok"] for r in rows), (p, rows)


@pytest.mark.parametrize("mask", sorted(EXTRAS))
@pytest.mark.parametrize("layout,gqa,dtype,softmax", [
    ("BSHD", False, "float32", "jax"), ("BHSD", True, "float32", "manual"),
    ("folded", False, "bfloat16", "recip"), ("BSHD", True, "bfloat16", "unstable")])
def test_extras_compute_the_same(mask, layout, gqa, dtype, softmax, kernels):
    """Every extra operand kind in every layout (the random programs above draw few)."""
    p = dict(layout=layout, scale="mul", mask=mask, fill=-1e9, softmax=softmax, axis="keys",
             extra=None, v_left=layout == "BHSD", gqa=gqa, dtype=dtype, seq_k=16)
    test_rewritten_programs_compute_the_same.hypothesis.inner_test(p, kernels)
