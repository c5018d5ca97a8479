"""CUDA kernels on a real GPU (`pytest -m gpu`); skipped without one.

Every spec forward (o, lse) and backward (dq, dk, dv) against the float64 reference, outputs
poisoned with NaN by the handlers (FLASHGEN_POISON, set in conftest), fresh random inputs.
Error bands (relative to max(max|ref|, 1)): f32 runs on TF32 tensor cores (10-bit mantissa
products, f32 accumulation) so 5e-3; f16 5e-3 forward / 2e-2 backward; bf16 2e-2 / 5e-2.
"""
import itertools
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

TOL = {"f32": (5e-3, 1e-2), "f16": (5e-3, 2e-2), "bf16": (2e-2, 5e-2)}
# `bench/gpu_session.sh all` narrows the library to what one device call can build
# (FLASHGEN_GPU_HEAD_DIMS=64,128 FLASHGEN_GPU_DTYPES=bf16,f16); a test of another spec skips.
HEAD_DIMS = tuple(int(d) for d in os.environ.get("FLASHGEN_GPU_HEAD_DIMS", "32,64,96,128,160,192,224,256").split(","))
DTYPES = tuple(os.environ.get("FLASHGEN_GPU_DTYPES", "f16,bf16,f32").split(","))


def _needs(d, dtype):
    if d not in HEAD_DIMS or dtype not in DTYPES:
        pytest.skip(f"d{d} {dtype} is not in this run's library (FLASHGEN_GPU_HEAD_DIMS / FLASHGEN_GPU_DTYPES)")


@pytest.fixture(scope="module", autouse=True)
def cuda_library():
    import jax
    from flashgen import KernelSpec, build, runtime
    from flashgen.jax.attention import local_target
    target = local_target()
    specs = [KernelSpec(h, t, c, target) for h in HEAD_DIMS for t in DTYPES for c in (False, True)]
    t = time.perf_counter()
    lib = build(specs, progress=lambda m: print(m, file=sys.stderr))
    print(f"CUDA library for {jax.devices()[0].device_kind} ({target}) in {time.perf_counter() - t:.0f}s",
          file=sys.stderr)
    runtime.load(lib.path)
    return lib


def _rel(got, want):
    want = np.asarray(want, np.float64)
    return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / max(np.max(np.abs(want)), 1.0))


def _check(rng, dtype, d, causal, b, sq, sk, hq, hkv, bottom_right=False):
    _needs(d, dtype)
    import jax
    import jax.numpy as jnp
    from flashgen import reference
    from flashgen.jax.attention import _kernel_calls, local_target
    from flashgen.spec import KernelSpec
    jdt = {"f32": jnp.float32, "f16": jnp.float16, "bf16": jnp.bfloat16}[dtype]
    q, k, v, do = (jnp.asarray(rng.standard_normal(s), jdt) for s in
                   ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d), (b, sq, hq, d)))
    spec = KernelSpec(d, dtype, causal, local_target())
    scale = 1.0 / np.sqrt(d)
    fwd, bwd = _kernel_calls(spec, scale, (bottom_right, (-1, -1), 0.0, (), False))
    o, lse = jax.jit(fwd)(q, k, v)
    dq, dk, dv = jax.jit(bwd)(q, k, v, o, lse, do)
    ref_o, ref_lse, ref_g = reference.attention(q, k, v, causal=causal, bottom_right=bottom_right, do=do)
    finite = np.isfinite(ref_lse)
    assert np.all(np.isneginf(np.asarray(lse)[~finite])), "rows that see no key must have lse = -inf"
    errs = {"o": _rel(o, ref_o), "lse": _rel(np.asarray(lse)[finite], ref_lse[finite]),
            "dq": _rel(dq, ref_g[0]), "dk": _rel(dk, ref_g[1]), "dv": _rel(dv, ref_g[2])}
    fwd_tol, bwd_tol = TOL[dtype]
    assert errs["o"] <= fwd_tol and errs["lse"] <= fwd_tol, errs
    assert max(errs["dq"], errs["dk"], errs["dv"]) <= bwd_tol, errs
    return errs


@pytest.mark.parametrize("d, dtype, causal", list(itertools.product(HEAD_DIMS, DTYPES, (False, True))))
def test_every_spec(rng, d, dtype, causal):
    errs = _check(rng, dtype, d, causal, b=2, sq=1000, sk=1000, hq=8, hkv=2)
    print(f"d{d} {dtype} causal={causal}: " + " ".join(f"{k}={v:.1e}" for k, v in errs.items()))


@pytest.mark.parametrize("sq, sk", [(1, 1), (17, 17), (129, 129), (1000, 1000), (4097, 4097), (17, 1000),
                                    (1000, 17), (1, 4097), (129, 4097)])
@pytest.mark.parametrize("causal, bottom_right", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_tails_and_alignment(rng, sq, sk, causal, bottom_right, dtype):
    _check(rng, dtype, 128, causal, b=1, sq=sq, sk=sk, hq=4, hkv=4, bottom_right=bottom_right)


@pytest.mark.parametrize("hq, hkv", [(16, 16), (16, 2), (16, 1)])
def test_gqa_mqa_filling_the_gpu(rng, hq, hkv):
    _check(rng, "bf16", 64, True, b=8, sq=2048, sk=2048, hq=hq, hkv=hkv)


def test_mixed_program_on_xla_stream(rng):
    """flashgen calls between XLA ops in one jit: right answer, and no host sync per call."""
    import jax
    import jax.numpy as jnp
    from flashgen.jax import flash_attention
    q, k, v = (jnp.asarray(rng.standard_normal((4, 512, 8, 64)), jnp.bfloat16) for _ in range(3))

    def layers(q, k, v, n=8):
        x = q
        for _ in range(n):
            x = flash_attention(jnp.tanh(x) * 2, k, v, causal=True)
        return x

    def ref_layers(q, k, v, n=8):
        x = q
        for _ in range(n):
            x = jax.nn.dot_product_attention(jnp.tanh(x) * 2, k, v, is_causal=True, implementation="xla")
        return x

    got = jax.jit(layers)(q, k, v)
    want = jax.jit(ref_layers)(q, k, v)
    assert _rel(got, want) < 5e-2
    f = jax.jit(layers)
    jax.block_until_ready(f(q, k, v))
    t = time.perf_counter()
    out = f(q, k, v)  # dispatch is asynchronous: it must return before the GPU is done
    dispatch = time.perf_counter() - t
    jax.block_until_ready(out)
    total = time.perf_counter() - t
    assert dispatch < total, (dispatch, total)


@pytest.mark.skipif(not shutil.which("compute-sanitizer"), reason="compute-sanitizer not installed")
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_compute_sanitizer(tool, tmp_path):
    """One spec per kernel family (fwd, bwd; f16/bf16 and f32; causal and not; GQA, tails), and
    the variants: extras with dbias, varlen, paged decode."""
    script = tmp_path / "run.py"
    script.write_text(
        "import numpy as np, jax, jax.numpy as jnp\n"
        "from flashgen.jax import flash_attention, flash_attention_paged, flash_attention_varlen\n"
        "rng = np.random.default_rng()\n"
        "for dt, d, c in [(jnp.bfloat16, 64, True), (jnp.float16, 128, False), (jnp.float32, 32, True)]:\n"
        "    q = jnp.asarray(rng.standard_normal((1, 77, 4, d)), dt)\n"
        "    k = jnp.asarray(rng.standard_normal((1, 131, 2, d)), dt)\n"
        "    v = jnp.asarray(rng.standard_normal((1, 131, 2, d)), dt)\n"
        "    g = jax.grad(lambda q, k, v: flash_attention(q, k, v, causal=c).astype(jnp.float32).sum(), (0, 1, 2))(q, k, v)\n"
        "    jax.block_until_ready(g)\n"
        "    # issue 8: extras (+dbias), varlen with padding rows, paged decode with split-KV\n"
        "    bias = jnp.asarray(rng.standard_normal((1, 4, 77, 131)), dt)\n"
        "    seg = jnp.asarray(np.sort(rng.integers(0, 3, (1, 77))), jnp.int32)\n"
        "    kseg = jnp.asarray(np.sort(rng.integers(0, 3, (1, 131))), jnp.int32)\n"
        "    f = lambda q, k, v, b: flash_attention(q, k, v, b, alibi_slopes=jnp.ones(4), q_segment_ids=seg,\n"
        "                                           kv_segment_ids=kseg, causal=c).astype(jnp.float32).sum()\n"
        "    jax.block_until_ready(jax.grad(f, (0, 1, 2, 3))(q, k, v, bias))\n"
        "    cu = jnp.asarray([0, 5, 5, 60], jnp.int32)\n"
        "    fv = lambda q, k, v: flash_attention_varlen(q, k, v, cu, cu, 55, 55, causal=c).astype(jnp.float32).sum()\n"
        "    jax.block_until_ready(jax.grad(fv, (0, 1, 2))(q[0], k[0, :77], v[0, :77]))\n"
        "    kc = jnp.asarray(rng.standard_normal((40, 16, 2, d)), dt)\n"
        "    table = jnp.asarray(rng.permutation(40)[:36].reshape(2, 18), jnp.int32)\n"
        "    o = flash_attention_paged(q[:, :1].repeat(2, 0), kc, kc, table, jnp.asarray([280, 3], jnp.int32),\n"
        "                              causal=True, bottom_right=True)\n"
        "    jax.block_until_ready(o)\n"
        "print('done')\n")
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    out = subprocess.run(["compute-sanitizer", f"--tool={tool}", "--target-processes=all",
                          "--kernel-name", "regex:flashgen", sys.executable, str(script)],
                         capture_output=True, text=True, env=env, timeout=900)
    tail = (out.stdout + out.stderr)[-3000:]
    print(tail)
    assert "done" in out.stdout, tail
    assert "ERROR SUMMARY: 0 errors" in out.stdout + out.stderr, tail


# ----------------------------------------------------------------------------- issue 8: window, softcap
def _check_variant(rng, dtype, d, causal, b, sq, sk, hq, hkv, bottom_right=False, window=(-1, -1),
                   softcap=0.0, sd=1.0):
    """_check with a sliding window / softcap (runtime attributes of the same specs)."""
    _needs(d, dtype)
    import jax
    import jax.numpy as jnp
    from flashgen import reference
    from flashgen.jax.attention import _kernel_calls, local_target
    from flashgen.spec import KernelSpec
    jdt = {"f32": jnp.float32, "f16": jnp.float16, "bf16": jnp.bfloat16}[dtype]
    q, k, v, do = (jnp.asarray(rng.standard_normal(s) * (sd if i < 2 else 1.0), jdt) for i, s in
                   enumerate(((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d), (b, sq, hq, d))))
    spec = KernelSpec(d, dtype, causal, local_target())
    scale = 1.0 / np.sqrt(d)
    fwd, bwd = _kernel_calls(spec, scale, (bottom_right, tuple(window), float(softcap), (), False))
    o, lse = jax.jit(fwd)(q, k, v)
    dq, dk, dv = jax.jit(bwd)(q, k, v, o, lse, do)
    ref_o, ref_lse, ref_g = reference.attention(q, k, v, causal=causal, bottom_right=bottom_right,
                                                window=window, softcap=softcap, do=do)
    finite = np.isfinite(ref_lse)
    assert np.all(np.isneginf(np.asarray(lse)[~finite])), "rows that see no key must have lse = -inf"
    assert np.all(np.asarray(o, np.float32)[np.transpose(~finite, (0, 2, 1))] == 0)
    errs = {"o": _rel(o, ref_o), "lse": _rel(np.asarray(lse)[finite], ref_lse[finite]) if finite.any() else 0.0,
            "dq": _rel(dq, ref_g[0]), "dk": _rel(dk, ref_g[1]), "dv": _rel(dv, ref_g[2])}
    fwd_tol, bwd_tol = TOL[dtype]
    assert errs["o"] <= fwd_tol and errs["lse"] <= fwd_tol, errs
    assert max(errs["dq"], errs["dk"], errs["dv"]) <= bwd_tol, errs
    return errs


@pytest.mark.parametrize("causal, window", [(False, (0, 0)), (False, (64, 64)), (False, (100, 3)),
                                            (True, (0, -1)), (True, (127, -1)), (True, (300, 5)),
                                            (False, (-1, 17)), (False, (5000, 5000))])
@pytest.mark.parametrize("sq, sk", [(1000, 1000), (129, 777), (777, 129)])
@pytest.mark.parametrize("dtype, d", [("bf16", 64), ("f16", 128), ("f32", 64)])
def test_sliding_window(rng, causal, window, sq, sk, dtype, d):
    for bottom_right in (False, True):
        _check_variant(rng, dtype, d, causal, b=1, sq=sq, sk=sk, hq=4, hkv=2, bottom_right=bottom_right,
                       window=window)


@pytest.mark.parametrize("softcap", [1.0, 20.0])
@pytest.mark.parametrize("d, dtype", [(64, "bf16"), (128, "f16"), (256, "bf16"), (64, "f32"), (256, "f32")])
def test_softcap(rng, softcap, d, dtype):
    _check_variant(rng, dtype, d, False, b=2, sq=513, sk=513, hq=4, hkv=1, softcap=softcap, sd=2.0)
    _check_variant(rng, dtype, d, True, b=1, sq=700, sk=700, hq=2, hkv=2, softcap=softcap, sd=2.0,
                   window=(200, -1))


def test_window_and_return_lse_through_flash_attention(rng):
    _needs(64, "f32")
    import jax
    import jax.numpy as jnp
    from flashgen import reference
    from flashgen.jax import flash_attention
    q, k, v, do = (jnp.asarray(rng.standard_normal((2, 300, 4, 64)), jnp.float32) for _ in range(4))
    dlse = jnp.asarray(rng.standard_normal((2, 4, 300)), jnp.float32)
    kw = dict(causal=True, window=(50, -1), softcap=5.0)
    (o, lse), vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v, return_lse=True, **kw), q, k, v)
    ro, rlse, rg = reference.attention(q, k, v, do=do, dlse=dlse, **kw)
    assert _rel(o, ro) < 5e-3 and _rel(lse, rlse) < 5e-3
    for g, r in zip(vjp((do, dlse)), rg):
        assert _rel(g, r) < 1e-2


# ----------------------------------------------------------------------------- issue 8 variants
# The CPU tests' checks (tests/test_variants.py), run on the GPU with the GPU error bands.
def _variants():
    sys.path.insert(0, os.path.dirname(__file__))
    import test_variants
    return test_variants


@pytest.mark.parametrize("case", [
    dict(alibi=(4,), causal=True), dict(alibi=(2, 4), bottom_right=True),
    dict(bias=((2, 4, 300, 260), "f32")), dict(bias=((1, 1, 300, 260), "bf16"), causal=True),
    dict(bias=((2, 1, 300, 260), "f32"), softcap=5.0, window=(40, 8)),
    dict(mask=(2, 4, 300, 260)), dict(mask=(1, 1, 300, 260), causal=True),
    dict(segments=5, causal=True), dict(segments=3, alibi=(4,), bias=((1, 4, 300, 260), "f32")),
])
@pytest.mark.parametrize("d", [64, 128])
def test_dense_extras(rng, case, d):
    _needs(d, "bf16")
    _variants().check(rng, dtype="bf16", d=d, sq=300, sk=260, hq=4, hkv=2, tol=TOL, **case)


def test_varlen_forward_backward(rng):
    import jax
    from flashgen import reference
    from flashgen.jax import flash_attention_varlen
    tv = _variants()
    lens_q, lens_k = [5, 0, 700, 1, 130], [7, 3, 700, 0, 200]
    _needs(64, "bf16")
    for dtype, causal, br in (("bf16", True, True), ("f16", False, False), ("f32", True, False)):
        if dtype not in DTYPES:
            continue
        q, k, v, do, cu_q, cu_k = tv._packed(rng, lens_q, lens_k, 8, 2, 64, dtype, pad_q=3, pad_k=2)
        f = lambda q, k, v: flash_attention_varlen(q, k, v, cu_q, cu_k, 700, 700, causal=causal,
                                                   bottom_right=br)
        o, vjp = jax.vjp(jax.jit(f), q, k, v)
        ro, _, rg = reference.attention_varlen(q, k, v, cu_q, cu_k, do=do, causal=causal,
                                               bottom_right=br)
        assert _rel(o, ro) <= TOL[dtype][0]
        assert np.all(np.asarray(o, np.float32)[-3:] == 0)
        for g, r in zip(vjp(do), rg):
            assert _rel(g, r) <= TOL[dtype][1]


@pytest.mark.parametrize("b, sq, lens, block_size", [(1, 1, [30000], 16), (4, 1, [900, 0, 33, 4096], 256),
                                                     (2, 9, [500, 77], 64), (64, 1, [2048] * 64, 16)])
def test_paged_decode_and_split_kv(rng, b, sq, lens, block_size):
    _needs(128, "bf16")
    import jax
    from flashgen import reference
    from flashgen.jax import flash_attention_paged
    tv = _variants()
    q, kc, vc, table, used = tv._paged(rng, b, sq, 8, 1, 128, "bf16", block_size, lens)
    kw = dict(causal=True, bottom_right=True)
    o, lse = jax.jit(lambda *a: flash_attention_paged(*a, return_lse=True, **kw))(q, kc, vc, table, used)
    ro, rlse = reference.attention_paged(q, np.asarray(kc, np.float64), np.asarray(vc, np.float64),
                                         table, used, **kw)
    assert _rel(o, ro) <= TOL["bf16"][0]
    np.testing.assert_allclose(np.asarray(lse), rlse, rtol=1e-3, atol=1e-3)


# ----------------------------------------------------------------------------- issue 21
def test_deterministic_backward_is_the_same_bits_every_run(rng):
    """GQA (4 q heads per kv head) and several key blocks per query block: the default
    backward's dQ / dK / dV atomics may add in any order; deterministic=True must not."""
    _needs(64, "bf16")
    import jax
    import jax.numpy as jnp
    from flashgen import reference
    from flashgen.jax import flash_attention
    q, do = (jnp.asarray(rng.standard_normal((2, 1000, 8, 64)), jnp.bfloat16) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((2, 1000, 2, 64)), jnp.bfloat16) for _ in range(2))
    grads = jax.jit(lambda q, k, v, do: jax.vjp(
        lambda q, k, v: flash_attention(q, k, v, causal=True, deterministic=True), q, k, v)[1](do))
    first = [np.asarray(g) for g in grads(q, k, v, do)]
    for _ in range(3):
        assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(first, grads(q, k, v, do)))
    ref = reference.attention(q, k, v, causal=True, do=do)[2]
    assert max(_rel(g, r) for g, r in zip(first, ref)) <= TOL["bf16"][1]


@pytest.mark.parametrize("d, causal", [(64, True), (128, False)])
def test_fp8_forward(rng, d, causal):
    """The e4m3 forward (sm90a only) against float64 on the dequantized inputs, within
    tests/test_fp8.py's derived bound."""
    import jax
    from flashgen import reference
    from flashgen.jax import flash_attention
    from flashgen.jax.attention import local_target
    if local_target() != "sm90a":
        pytest.skip("the FP8 forward runs on sm90a only")
    sys.path.insert(0, os.path.dirname(__file__))
    import test_fp8
    (q, qs), (k, ks), (v, vs) = (test_fp8.quantize(rng, (2, 1000, 4, d), 2.0) for _ in range(3))
    o, lse = jax.jit(lambda *a: flash_attention(*a[:3], q_descale=a[3], k_descale=a[4], v_descale=a[5],
                                                causal=causal, return_lse=True))(q, k, v, qs, ks, vs)
    scale = float(np.float32(1 / np.sqrt(d)))
    ref = reference.attention_fp8(q, k, v, qs, ks, vs, causal=causal, scale=scale)
    bound = test_fp8.o_bound(q, k, v, (qs, ks, vs), scale, causal)
    o_err, lse_err = test_fp8.errors(np.asarray(o, np.float64), np.asarray(lse, np.float64), ref, bound)
    assert o_err <= 1.0 and lse_err <= test_fp8.LSE_TOL, (o_err, lse_err)
