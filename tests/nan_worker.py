"""Runs tests/test_nan.py's cases in a process of their own (FLASHGEN_POISON=finite is read
once per process): argv = output directory, cases as JSON. Saves per case the kernel's o, lse,
dq, dk, dv, the float64 reference's (ref_*) and `at`, the poisoned row / key."""
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from flashgen import KernelSpec, build, reference, runtime
from flashgen.jax import flash_attention

JNP = {"f32": jnp.float32, "bf16": jnp.bfloat16}
D = 32


def run_case(rng, dtype, causal, sq, sk, what):
    shapes = [(1, sq, 2, D), (1, sk, 1, D), (1, sk, 1, D), (1, sq, 2, D)]
    q, k, v, do = (rng.standard_normal(s).astype(np.float32) for s in shapes)
    scale, softcap, at, extra = None, 0.0, -1, {}
    if what in ("mask", "bias"):
        # A NaN key and V row that even rows do not see: through a boolean mask, or a -inf bias.
        at = int(rng.integers(1, sk))
        k[0, at, 0, int(rng.integers(D))] = v[0, at, 0, int(rng.integers(D))] = np.nan
        hide = np.zeros((1, 1, sq, sk), bool)
        hide[..., ::2, at] = True
        if what == "mask":
            extra["mask"] = ~hide & (rng.random((1, 1, sq, sk)) < 0.8)
            extra["mask"][..., 0] = True  # every row sees a key
        else:
            extra["bias"] = np.where(hide, -np.inf, rng.standard_normal((1, 1, sq, sk))).astype(np.float32)
    elif what in ("q", "k", "v", "do", "v_inf"):
        # Not a multiple of a block: the poisoned row sits inside a (diagonal) tile.
        at = int(rng.integers(5, min(sq, sk) - 5))
        x = {"q": q, "k": k, "v": v, "do": do, "v_inf": v}[what]
        x[0, at, -1 if what in ("q", "do") else 0, int(rng.integers(D))] = np.inf if what == "v_inf" else np.nan
    elif what == "v_chunk_ends":
        # Pinned, not drawn: the last row of a 64-key chunk (the CPU forward packs and checks V in
        # chunks of kFwdBk = 64 keys) and the last key, where an off-by-one in a chunk's scan hides.
        at = 63
        v[0, at, 0, int(rng.integers(D))] = v[0, sk - 1, 0, int(rng.integers(D))] = np.nan
    elif what == "v_odd_bf16":
        # Pinned odd: the high half of a bf16 pair in the vdpbf16ps kernels' interleaved V rows.
        at = 37
        v[0, at, 0, int(rng.integers(D))] = np.nan
    elif what == "v_window_straddle":
        # A left window of 50: q block [128, 256) starts at key 78, so its first key block [78, 142)
        # straddles two packed chunks ([64, 128), [128, 192)); the NaN V row 130 is in the second.
        at = 130
        v[0, at, 0, int(rng.integers(D))] = np.nan
        extra["window"] = (50, -1)
    elif what == "scale":
        scale = 1e38
    elif what == "softcap":
        softcap = float(np.finfo(np.float32).tiny) * 2
    # The reference sees the values the kernel sees (rounded to the kernel's dtype).
    q, k, v, do = (np.asarray(jnp.asarray(x, JNP[dtype]).astype(jnp.float32)) for x in (q, k, v, do))
    fn = lambda q, k, v: flash_attention(q, k, v, causal=causal, scale=scale, softcap=softcap,
                                         return_lse=True, **extra)
    args = [jnp.asarray(x, JNP[dtype]) for x in (q, k, v)]
    (o, lse), vjp = jax.vjp(jax.jit(fn), *args)
    dq, dk, dv = vjp((jnp.asarray(do, JNP[dtype]), jnp.zeros_like(lse)))
    if what == "scale":
        # f32 scores overflow where float64 ones would not: the reference takes the f32 scores
        # (the kernel's: scale·log2(e) folded, then back to natural units) as its inputs.
        s = np.einsum("bqhd,bkhd->bhqk", q, np.repeat(k, 2, axis=2)).astype(np.float32)
        s2 = s * np.float32(scale * np.log2(np.e))
        ref_o, ref_lse, grads = _reference_from_scores(s2.astype(np.float64) / np.log2(np.e), q, k, v, do,
                                                       causal)
    else:
        ref_o, ref_lse, grads = reference.attention(q, k, v, causal=causal, scale=scale, softcap=softcap, do=do,
                                                    **extra)
    out = {"o": o, "lse": lse, "dq": dq, "dk": dk, "dv": dv, "ref_o": ref_o, "ref_lse": ref_lse,
           "ref_dq": grads[0], "ref_dk": grads[1], "ref_dv": grads[2], "at": at}
    return {n: np.asarray(jnp.asarray(x, jnp.float32) if hasattr(x, "dtype") and x.dtype == jnp.bfloat16 else x,
                          np.float64) for n, x in out.items()}


def _reference_from_scores(s, q, k, v, do, causal):
    """reference.attention's forward with given (natural-unit) scores; gradients: NaN rows stay
    NaN, finite rows from the float64 reference with those scores (scale 1 on q·k = s)."""
    sq, sk = s.shape[2], s.shape[3]
    visible = reference.mask(sq, sk, causal)[None, None]
    seen = visible.any(-1, keepdims=True)
    with np.errstate(invalid="ignore", over="ignore"):
        s = np.where(visible, s, -np.inf)
        m = np.where(seen, s.max(-1, keepdims=True), 0.0)
        p = np.where(visible, np.exp(s - m), 0.0)
        l = p.sum(-1, keepdims=True)
        p = p / l
        lse = np.log(l[..., 0]) + m[..., 0]
        vr = np.repeat(np.asarray(v, np.float64), 2, axis=2)
        o = np.einsum("bhqk,bkhd->bqhd", p, vr)
        do = np.asarray(do, np.float64)
        dv = np.einsum("bhqk,bqhd->bkhd", p, do)
        dp = np.einsum("bqhd,bkhd->bhqk", do, vr)
        ds = np.where(visible, p * (dp - np.einsum("bqhd,bqhd->bhq", do, o)[..., None]), 0.0)
        scale = 1e38
        dq = np.einsum("bhqk,bkhd->bqhd", ds, np.repeat(np.asarray(k, np.float64), 2, axis=2)) * scale
        dk = np.einsum("bhqk,bqhd->bkhd", ds, np.asarray(q, np.float64)) * scale
    fold = lambda x: x.reshape(1, sk, 1, 2, D).sum(axis=3)
    return o, lse, (dq, fold(dk), fold(dv))


def main():
    out, cases = pathlib.Path(sys.argv[1]), json.loads(sys.argv[2])
    specs = sorted({KernelSpec(D, dt, c, "cpu") for dt, c, *_ in cases.values()}, key=str)
    runtime.load(build(specs).path)
    rng = np.random.default_rng()
    for name, (dtype, causal, sq, sk, what) in cases.items():
        np.savez(out / f"{name}.npz", **run_case(rng, dtype, causal, sq, sk, what))


if __name__ == "__main__":
    main()
