"""The CUDA kernels run on the CPU, through their FFI handlers' own host code, against float64.

Each library is the very objects of the GPU build (build(host="emulate")), its handlers
called by a minimal XLA FFI host with a stand-in CUDA runtime: validation, parameter
structs, grid sizing, scratch, poisoning (FLASHGEN_POISON, set in conftest, on top of
NaN-filled result buffers), the backward's three kernels and split-KV's combine all run as
compiled, and every launch executes the kernel's PTX in flashgen.emulate. Fresh random
inputs each run. Specs are chosen by compile cost: d64 bf16 causal and d128 f16 are the
ones test_cuda_build compiles anyway; the full sweep is marked slow.
"""
import functools

import numpy as np
import pytest

from conftest import assert_nan_where_the_reference_is, needs_nvcc
from flashgen.build import build
from flashgen import reference
from flashgen.emulate.check import LSE_TOLERANCE, TOLERANCE, Checker, relative_error
from flashgen.emulate.host import EmulatedLibrary, HandlerError
from flashgen.spec import DTYPES, KernelSpec

pytestmark = needs_nvcc


@functools.cache
def _library(spec: KernelSpec) -> EmulatedLibrary:
    return EmulatedLibrary(build(spec, host="emulate"))


def checker(rng, head_dim, dtype, causal, arch="sm80") -> Checker:
    spec = KernelSpec(head_dim, dtype, causal, arch)
    return Checker(_library(spec), spec, rng)


def assert_matches(result):
    bad = [r for r in result.rows if not r.ok]
    assert not bad, "\n".join(f"{r.spec} {r.family} [{r.case}] {r.output}: error {r.error:.3g} > {r.tolerance:g}"
                              for r in bad)
    return result


def launched(result, kernel: str) -> int:
    """How many launches of the case ran `kernel` (a template: its mangled name has
    `<length><name>I`)."""
    return sum(f"{len(kernel)}{kernel}I" in k for k in result.kernels)


# ---- dense, d64 bf16 causal ---------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["sm80", "sm90a"])
def test_dense_causal_bottom_right_gqa(rng, arch):
    r = assert_matches(checker(rng, 64, "bf16", True, arch).dense(
        seqlen_q=77, seqlen_k=129, heads_q=4, heads_kv=2, bottom_right=True))
    main = "flash_bwd_kernel" if arch == "sm80" else "hopper_bwd_kernel"  # sm90a: the wgmma backward
    assert launched(r, "flash_bwd_pre_kernel") == 1 and launched(r, main) == 1
    assert launched(r, "flash_bwd_convert_kernel") == 3  # dq, and dk / dv from the GQA accumulators


@pytest.mark.parametrize("seqlen_q,seqlen_k,bottom_right", [(129, 17, False), (17, 77, True), (1, 129, True),
                                                            (129, 77, True)])
def test_dense_causal_lengths_mqa(rng, seqlen_q, seqlen_k, bottom_right):
    # (129, 77) bottom-right: the first 52 rows see no key (o = 0, lse = -inf, zero gradients).
    assert_matches(checker(rng, 64, "bf16", True).dense(
        seqlen_q=seqlen_q, seqlen_k=seqlen_k, heads_q=2, heads_kv=1, bottom_right=bottom_right))


# ---- dense, d128 f16 non-causal: windows, softcap, every extra ----------------------------------
@pytest.mark.parametrize("window,softcap", [((16, -1), 0.0), ((8, 5), 0.0), ((-1, -1), 3.0), ((20, 0), 2.0)])
def test_window_softcap(rng, window, softcap):
    assert_matches(checker(rng, 128, "f16", False).dense(seqlen_q=70, seqlen_k=90, window=window,
                                                          softcap=softcap, heads_q=2, heads_kv=1))


def test_window_with_causal(rng):
    assert_matches(checker(rng, 64, "bf16", True).dense(seqlen_q=100, seqlen_k=100, window=(24, 0)))


@pytest.mark.parametrize("extras", [
    dict(alibi="H"), dict(alibi="BH", softcap=2.0),
    dict(bias=(1, 2)),                 # broadcast over batch: dbias sums over it (atomics)
    dict(bias=(2, 1), bias_f32=True),  # broadcast over heads, an f32 bias accumulates in place
    dict(mask=(2, 2)),                 # with a fully masked row
    dict(segment_ids=True),            # a query segment with no keys
    dict(bias=(2, 2), mask=(1, 2), segment_ids=True, alibi="H"),
    # one f16 bias for every batch entry and head: its dbias (41 x 71) is no multiple of the 4
    # elements the f32 -> f16 conversion moves at a time
    dict(bias=(1, 1), seqlen_q=41, seqlen_k=71),
])
def test_extras(rng, extras):
    r = assert_matches(checker(rng, 128, "f16", False).dense(**{"batch": 2, "seqlen_q": 40, "seqlen_k": 70, **extras}))
    assert ("dbias" in [row.output for row in r.rows]) == ("bias" in extras)


def test_extras_causal_bias_gqa(rng):
    assert_matches(checker(rng, 64, "bf16", True).dense(batch=2, seqlen_q=50, seqlen_k=64, heads_q=4, heads_kv=2,
                                                         bottom_right=True, bias=(1, 4), mask=(2, 1)))


# ---- varlen and paged ---------------------------------------------------------------------------
def test_varlen_causal_with_empty_sequence(rng):
    r = assert_matches(checker(rng, 64, "bf16", True).varlen(seqlens_q=(17, 0, 45), seqlens_k=(30, 0, 45),
                                                             pad_q=3, pad_k=5, bottom_right=True))
    assert launched(r, "flash_fwd_varlen_fill_kernel") == 1


# 64 sequences whose bottom-right offsets Sk - Sq run over -32 .. 31: a band edge falls at every
# offset into a 64-key block in one call (the kernels' tiles are 16 .. 128 keys and rows), so a
# block-skipping or edge test off by one, which leaks or drops one block's corner pair, fails.
# One edge per case: a block whose corner alone crosses one edge must lie inside the other; f32 or
# f16, whose tolerances see one leaked pair (bf16's may not: a causal sm90a case in bf16 missed one).
# Each sequence has a full block of rows at every tile height of its family (sm80: 128, sm90a: 64)
# and more keys than a 64-key block (a tail block is masked whatever the band).
_EDGE_Q = {"sm80": tuple(130 + (7 * b) % 31 for b in range(64)),
           "sm90a": tuple(100 + (7 * b) % 31 for b in range(64))}


@pytest.mark.parametrize("head_dim,dtype,causal,window,arch", [
    (64, "f32", False, (40, -1), "sm80"), (64, "f32", False, (-1, 40), "sm80"), (64, "bf16", True, (-1, -1), "sm80"),
    (128, "f16", False, (40, -1), "sm90a"), (128, "f16", False, (-1, 40), "sm90a")])
def test_window_edges_at_every_block_offset(rng, head_dim, dtype, causal, window, arch):
    assert_matches(checker(rng, head_dim, dtype, causal, arch).varlen(
        seqlens_q=_EDGE_Q[arch], seqlens_k=tuple(sq + b - 32 for b, sq in enumerate(_EDGE_Q[arch])),
        bottom_right=True, window=window, heads_q=1, heads_kv=1))


def test_varlen_alibi_window(rng):
    assert_matches(checker(rng, 128, "f16", False).varlen(seqlens_q=(33, 0, 20), alibi="BH", window=(10, 10)))


@pytest.mark.parametrize("block_size", [16, 48])
def test_paged_split_kv(rng, block_size):
    # One decode row per (batch, head) leaves the SMs idle: the handler splits the keys and
    # combines. seqused_k: a long row, an empty one, one shorter than its table row.
    r = assert_matches(checker(rng, 64, "bf16", True).paged(seqused_k=(300, 0, 41), block_size=block_size))
    assert launched(r, "flash_fwd_combine_kernel") == 1


def test_paged_alibi_softcap_f16(rng):
    assert_matches(checker(rng, 128, "f16", False).paged(seqused_k=(90, 7), seqlen_q=3, block_size=16,
                                                          alibi="H", softcap=4.0, bottom_right=True))


def test_varlen_softcap_gqa_and_paged_alibi_bh_window(rng):
    c = checker(rng, 64, "bf16", True)
    assert_matches(c.varlen(seqlens_q=(20, 33), seqlens_k=(40, 33), heads_q=4, heads_kv=2, softcap=3.0,
                            bottom_right=True))
    assert_matches(c.paged(seqused_k=(200, 9), seqlen_q=2, block_size=48, alibi="BH", window=(30, 0)))


def test_paged_without_scratch_runs_unsplit(rng):
    # XLA may refuse scratch: the handler then runs one split, still exact.
    c = checker(rng, 64, "bf16", True)
    limited = Checker(_Limited(c.lib, 0), c.spec, rng)
    r = assert_matches(limited.paged(seqused_k=(300, 41), block_size=16))
    assert launched(r, "flash_fwd_combine_kernel") == 0


class _Limited:
    """An EmulatedLibrary whose host refuses scratch beyond `limit` bytes."""

    def __init__(self, lib, limit):
        self.lib, self.limit = lib, limit

    def call(self, *args, **kw):
        return self.lib.call(*args, scratch_limit=self.limit, **kw)


# ---- other dtypes and head dims -----------------------------------------------------------------
def test_f32_dense(rng):
    assert_matches(checker(rng, 64, "f32", False).dense(seqlen_q=45, seqlen_k=70, heads_q=2, heads_kv=1))


def test_key_only_bias_broadcast_over_queries(rng):
    # [B, 1, 1, Sk]: row stride 0 in the kernels; dbias's atomics sum the queries into one row
    assert_matches(checker(rng, 64, "bf16", True).dense(batch=2, seqlen_q=24, seqlen_k=40, heads_q=2, heads_kv=1,
                                                         bottom_right=True, bias=(2, 1, 1)))


def test_d256_dbias_is_not_doubled(rng):
    # Head dims > 128 split each key block's dK/dV columns over two CTAs (NSPLIT = 2), both of
    # which recompute dS: only one may add it into dbias.
    assert_matches(checker(rng, 256, "bf16", False).dense(batch=2, seqlen_q=40, heads_q=2, heads_kv=2, bias=(1, 2)))


def test_every_kernel_entry_point_runs(rng):
    """Each __global__ entry the spec's PTX holds (dense, extras, varlen, varlen+ALiBi, paged,
    paged+ALiBi forwards; the backward's pre, four main variants, their deterministic twins and
    convert; the varlen fill and split-KV combine) is launched by some handler and matches float64."""
    c = checker(rng, 64, "bf16", True)
    cases = [c.dense(seqlen_q=20, deterministic=d) for d in (False, True)] + \
            [c.dense(seqlen_q=20, alibi="H", deterministic=d) for d in (False, True)] + \
            [c.varlen(seqlens_q=(9, 0, 12), deterministic=d) for d in (False, True)] + \
            [c.varlen(seqlens_q=(9, 12), alibi="H", deterministic=d) for d in (False, True)] + \
            [c.paged(seqused_k=(300,), block_size=16), c.paged(seqused_k=(20,), alibi="H")]
    ran = {k for r in cases for k in assert_matches(r).kernels}
    assert ran == set(c.lib.kernels), f"never launched: {sorted(set(c.lib.kernels) - ran)}"


def test_overflowed_rows_are_nan_with_extras_and_paged(rng):
    """A row whose visible scores all overflow to -inf is NaN (IEEE softmax) in the extras and
    paged kernels too (split-KV partials and combine included); a row that sees no key stays
    o = 0, lse = -inf. q = -1e37 against keys >= 1: q.k < -3.4e38 in the f32 accumulators."""
    c = checker(rng, 64, "bf16", True)
    attrs = c._attrs(False, (-1, -1), 0.0, "mask").values("fwd")
    b, s, h, d = 1, 40, 1, 64
    q, v = c._normal(b, s, h, d), c._normal(b, s, h, d)
    k = (np.abs(c._normal(b, s, h, d)) + 1).astype(c.dt)
    q[0, s - 1] = -1e37                     # sees every key (causal): all -inf, not masked
    mask = rng.random((1, 1, s, s)) < 0.8
    mask[..., s - 1, :] = True
    mask[..., 7, :] = False                 # sees no key
    (o, lse), _ = c.lib.call(c.spec.target_name("fwd"), [q, k, v, mask],
                             [((b, s, h, d), c.dt), ((b, h, s), np.float32)], **attrs)
    o, lse = o.astype(np.float64), lse.astype(np.float64)
    assert np.isnan(o[0, s - 1]).all() and np.isnan(lse[0, 0, s - 1])
    assert (o[0, 7] == 0).all() and lse[0, 0, 7] == -np.inf
    ro, rlse = reference.attention(q, k, v, causal=True, scale=c.scale, mask=mask)[:2]
    rows = [i for i in range(s) if i not in (7, s - 1)]
    assert relative_error(o[0, rows], ro[0, rows]) < TOLERANCE["bf16"]
    assert relative_error(lse[0, :, rows], rlse[0, :, rows]) < LSE_TOLERANCE

    used = np.array([300, 0, 41], np.int32)   # 300 keys: the handler splits
    bs, mb = 16, 20
    table = rng.permutation(3 * mb).reshape(3, mb).astype(np.int32)
    kc = (np.abs(c._normal(3 * mb, bs, h, d)) + 1).astype(c.dt)
    vc, qd = c._normal(3 * mb, bs, h, d), c._normal(3, 1, h, d)
    qd[0] = -1e37
    (o, lse), rec = c.lib.call(c.spec.target_name("fwd_paged"), [qd, kc, vc, table, used],
                               [((3, 1, h, d), c.dt), ((3, h, 1), np.float32)],
                               **c._attrs(True, (-1, -1), 0.0).values("fwd_paged"))
    assert any("24flash_fwd_combine_kernelI" in l.entry for l in rec.launches)
    o, lse = o.astype(np.float64), lse.astype(np.float64)
    assert np.isnan(o[0]).all() and np.isnan(lse[0]).all()
    assert (o[1] == 0).all() and (lse[1] == -np.inf).all()
    ro, rlse = reference.attention_paged(qd, kc, vc, table, used, causal=True, scale=c.scale, bottom_right=True)[:2]
    assert relative_error(o[2], ro[2]) < TOLERANCE["bf16"] and relative_error(lse[2], rlse[2]) < LSE_TOLERANCE


@pytest.mark.parametrize("arch", ["sm80", "sm90a"])
@pytest.mark.parametrize("layout", ["dense", "varlen"])
def test_overflowed_rows_are_nan_without_extras(rng, layout, arch):
    """The kernels without extras tell an overflowed row from one without keys by the band alone
    (the forwards' epilogues): a row whose visible scores all overflow is NaN, a row the bottom-right
    causal band gives no key stays o = 0, lse = -inf (the first Sq - Sk rows here). Row Sq - Sk
    sees exactly one key: the band's last key is also its first (an epilogue that took the band
    as [lo, hi) made that row o = 0, lse = -inf)."""
    c = checker(rng, 64, "bf16", True, arch)
    sq, sk, h, d = 40, 30, 1, 64
    q, v = c._normal(sq, h, d), c._normal(sk, h, d)
    k = (np.abs(c._normal(sk, h, d)) + 1).astype(c.dt)
    q[sq - 1] = -1e37                       # sees every key: all -inf, not masked
    q[sq - sk] = -1e37                      # sees key 0 alone: -inf, not masked
    if layout == "dense":
        attrs = c._attrs(True, (-1, -1), 0.0).values("fwd")
        (o, lse), _ = c.lib.call(c.spec.target_name("fwd"), [q[None], k[None], v[None]],
                                 [((1, sq, h, d), c.dt), ((1, h, sq), np.float32)], **attrs)
        o, lse = o[0], lse[0]
    else:
        cu_q, cu_k = np.array([0, sq], np.int32), np.array([0, sk], np.int32)
        attrs = c._attrs(True, (-1, -1), 0.0, max_seqlen=(sq, sk)).values("fwd_varlen")
        (o, lse), _ = c.lib.call(c.spec.target_name("fwd_varlen"), [q, k, v, cu_q, cu_k],
                                 [((sq, h, d), c.dt), ((h, sq), np.float32)], **attrs)
    o, lse = o.astype(np.float64), lse.astype(np.float64)
    for row in (sq - sk, sq - 1):
        assert np.isnan(o[row]).all() and np.isnan(lse[:, row]).all(), f"row {row}"
    assert (o[:sq - sk] == 0).all() and (lse[:, :sq - sk] == -np.inf).all()
    ro, rlse = reference.attention(q[None], k[None], v[None], causal=True, scale=c.scale, bottom_right=True)[:2]
    rows = [i for i in range(sq) if i not in (sq - sk, sq - 1)]
    assert relative_error(o[rows], ro[0, rows]) < TOLERANCE["bf16"]
    assert relative_error(lse[:, rows], rlse[0][:, rows]) < LSE_TOLERANCE


def test_hopper_forward_nan_reaches_the_rows_that_see_it(rng):
    """sm90a's forward under a NaN query row and a NaN key (test_nan.py runs sm80's): o and lse
    NaN exactly in that row and in the rows that see the key, finite and within tolerance
    elsewhere. Several query and key blocks, causal: the rows before the key mask its NaN score."""
    c = checker(rng, 64, "bf16", True, "sm90a")
    s, h, d = 150, 1, 64
    q, k, v = (c._normal(1, s, h, d) for _ in range(3))
    q[0, 9, 0, 5] = np.nan
    k[0, 100, 0, 7] = np.nan
    (o, lse), _ = c.lib.call(c.spec.target_name("fwd"), [q, k, v], [((1, s, h, d), c.dt), ((1, h, s), np.float32)],
                             **c._attrs(False, (-1, -1), 0.0).values("fwd"))
    ro, rlse = reference.attention(q, k, v, causal=True, scale=c.scale)[:2]
    assert np.flatnonzero(np.isnan(rlse[0, 0])).tolist() == [9, *range(100, s)]
    assert_nan_where_the_reference_is(o, ro, TOLERANCE["bf16"], "o")
    assert_nan_where_the_reference_is(lse, rlse, LSE_TOLERANCE, "lse")


@pytest.mark.parametrize("arch,extras", [("sm80", False), ("sm80", True), ("sm90a", False)],
                         ids=["sm80", "sm80-extras", "sm90a"])
@pytest.mark.parametrize("poisoned", ["v", "do"])
def test_a_nan_dp_gives_masked_pairs_no_gradient(rng, poisoned, arch, extras):
    """dP = V dO^T is NaN over a whole key column when a V row is NaN, and over a whole query row
    when a dO row is: the pairs of it that the causal band masks must still get dS = 0 (README
    "NaN and overflow"), so that the NaN reaches the dq of the rows that see the key and the dk of
    the keys the row sees, not the others (test_nan.py checks a NaN V row on sm80 dense; this, both
    families, the extras kernel (a boolean mask besides the band, and a bias whose dbias takes the
    NaN of the pairs it reaches) and a NaN dO row). Several query and key blocks; the backward runs
    on the reference's o and lse, and dq, dk, dbias (and dv for a NaN V row) are held to
    flashgen.reference's rules. Not checked: the forward's o and the dv of a NaN dO row, where on
    CUDA a NaN still reaches the masked pairs of its tile through the MMA's 0 * NaN (README "What
    needs a GPU"). The outputs are poisoned with NaN, so the finite values are the check."""
    c = checker(rng, 64, "bf16", True, arch)
    s, h, d = 150, 1, 64
    q, k, v, do = (c._normal(1, s, h, d) for _ in range(4))
    if poisoned == "v":
        v[0, 70] = np.nan           # dq of rows >= 70 (and, through their D, every dk)
    else:
        do[0, 20] = np.nan          # dq of row 20, dk of keys <= 20
    # in the calls' operand order (contract.normalize_extras)
    ops = {"bias": c._normal(1, 1, s, s), "mask": rng.random((1, 1, s, s)) < 0.8} if extras else {}
    o, lse, grads = reference.attention(q, k, v, causal=True, scale=c.scale, do=do, **ops)[:3]
    attrs = c._attrs(False, (-1, -1), 0.0, tuple(ops)).values("bwd")
    results = [((1, s, h, d), c.dt)] * 3 + [((1, 1, s, s), c.dt)] * bool(ops)
    got, _ = c.lib.call(c.spec.target_name("bwd"), [q, k, v, o.astype(c.dt), lse.astype(np.float32), do,
                                                    *ops.values()], results, **attrs)
    assert 0 < np.isnan(grads[0]).sum() < grads[0].size, "the reference's dq must hold NaN and finite rows"
    for name, g, want in zip(("dq", "dk", "dv", "dbias"), got, grads):
        if name != "dv" or poisoned == "v":
            assert_nan_where_the_reference_is(g, want, TOLERANCE["bf16"], name)


@pytest.mark.parametrize("seqused_k,max_blocks", [((53, 99), 4), ((53, 400, 300), 20)], ids=["unsplit", "split-KV"])
def test_paged_table_outside_the_cache_masks_and_seqused_k_clamps(rng, seqused_k, max_blocks):
    """The block table and seqused_k are device data that the CUDA handler cannot read (the CPU
    handler refuses bad values): a block id outside [0, num_blocks) -- one past the end, negative --
    masks its keys, never reads outside the cache (the emulator faults on such a read), and
    seqused_k past what a table row holds (max_blocks * block_size) is clamped to it, never
    reads past the row. Non-causal, so masked keys are absent keys for the reference."""
    c = checker(rng, 64, "f32", False)
    b, bs, mb, h, d = len(seqused_k), 16, max_blocks, 2, 64
    nb = b * mb + 1
    table = rng.permutation(nb)[:b * mb].reshape(b, mb).astype(np.int32)
    table[0, 1], table[0, 2] = nb, -1
    q, kc, vc = c._normal(b, 3, h, d), c._normal(nb, bs, h, d), c._normal(nb, bs, h, d)
    (o, lse), rec = c.lib.call(c.spec.target_name("fwd_paged"), [q, kc, vc, table, np.asarray(seqused_k, np.int32)],
                               [((b, 3, h, d), c.dt), ((b, h, 3), np.float32)],
                               **c._attrs(False, (-1, -1), 0.0).values("fwd_paged"))
    split = any("24flash_fwd_combine_kernelI" in l.entry for l in rec.launches)
    assert split == (b == 3), "the case meant to split KV did not, or the other did"
    for i, used in enumerate(seqused_k):
        keys = [j for j in range(min(used, mb * bs)) if 0 <= table[i, j // bs] < nb]
        k = np.stack([kc[table[i, j // bs], j % bs] for j in keys])
        v = np.stack([vc[table[i, j // bs], j % bs] for j in keys])
        ro, rlse = reference.attention(q[i:i + 1], k[None], v[None], scale=c.scale)[:2]
        assert relative_error(o[i:i + 1], ro) < TOLERANCE["f32"], f"batch {i} o"
        assert relative_error(lse[i:i + 1], rlse) < LSE_TOLERANCE, f"batch {i} lse"


# ---- the handler refuses bad arguments before anything runs -------------------------------------
def test_a_library_is_parsed_and_compiled_once_per_process():
    """A second EmulatedLibrary of the same build reuses the parsed kernels and their compiled form."""
    spec = KernelSpec(64, "bf16", True, "sm80")
    first, second = _library(spec), EmulatedLibrary(build(spec, host="emulate"))
    assert first.kernels.keys() == second.kernels.keys()
    assert all(first.kernels[n][1] is second.kernels[n][1] for n in first.kernels)


def test_mismatched_shapes_are_a_handler_error_and_launch_nothing(rng):
    c = checker(rng, 64, "bf16", True)
    q = np.zeros((1, 8, 2, 64), c.dt)
    k = np.zeros((1, 8, 2, 32), c.dt)  # wrong head dim
    with pytest.raises(HandlerError, match="head") as e:
        c.lib.call(c.spec.target_name("fwd"), [q, k, k], [((1, 8, 2, 64), c.dt), ((1, 2, 8), np.float32)],
                   **c._attrs(False, (-1, -1), 0.0).values("fwd"))
    assert e.value.record.launches == [] and e.value.record.host_accesses == []


# ---- the full sweep (slow) ----------------------------------------------------------------------
SWEEP = [(d, t, c) for d in (64, 128) for t in DTYPES for c in (False, True)] + \
        [(d, "bf16", False) for d in (32, 96, 192, 256)]


@pytest.mark.slow
@pytest.mark.parametrize("head_dim,dtype,causal", SWEEP)
def test_sweep(rng, head_dim, dtype, causal):
    c = checker(rng, head_dim, dtype, causal)
    assert_matches(c.dense(seqlen_q=77, seqlen_k=129, heads_q=2, heads_kv=1, bottom_right=causal))
    assert_matches(c.dense(batch=2, seqlen_q=33, seqlen_k=40, bias=(1, 2), mask=(2, 1), segment_ids=True,
                           alibi="BH", softcap=2.0))
    assert_matches(c.varlen(seqlens_q=(17, 0, 40)))
    assert_matches(c.paged(seqused_k=(300, 0, 41), block_size=48))


# ---- the user-facing check ----------------------------------------------------------------------
def test_cli_check_emulate_prints_the_error_table(capsys):
    from flashgen.cli import main
    assert main(["check", "--target", "sm80", "--emulate", "--hdim", "64", "--dtype", "bf16", "--causal"]) == 0
    out = capsys.readouterr().out
    for family in ("dense", "extras", "varlen", "paged"):
        assert family in out
    assert "FAIL" not in out and "outputs within tolerance" in out


def test_cli_check_needs_emulate(capsys):
    from flashgen.cli import main
    assert main(["check", "--target", "sm80", "--hdim", "64"]) == 2
    assert "--emulate" in capsys.readouterr().err


def test_cli_check_refuses_bad_targets_and_outputs_before_building(capsys, tmp_path, fresh_cache):
    from flashgen.cli import main
    assert main(["check", "--target", "sm80,cpu", "--emulate", "--hdim", "64"]) == 2
    assert "sm80 and sm90a" in capsys.readouterr().err
    assert main(["check", "--target", "sm80", "--emulate", "--hdim", "64", "--json", str(tmp_path)]) == 2
    assert "--json" in capsys.readouterr().err
    assert not fresh_cache.exists() or not any(fresh_cache.rglob("*.so"))  # nothing was built


def test_check_summary_reads_worst_errors_and_pace():
    from flashgen.emulate.check import Row, summarize
    rows = [Row("dense", "d64_bf16_causal", "sq=77", "o", 4e-3, 1.5e-2, 2.0, 1000, 1, ""),
            Row("dense", "d64_bf16_causal", "sq=77", "lse", 1e-3, 1.5e-2, 2.0, 1000, 1, ""),
            Row("dense", "d128_f32", "sq=77", "o", 5e-7, 1e-5, 1.0, 500, 1, ""),
            Row("paged", "d64_bf16", "seqused_k=(1,)", "o", 2e-3, 1.5e-2, 1.0, 1500, 2, "")]
    text = summarize(rows)
    dense = next(l for l in text.splitlines() if l.strip().startswith("dense"))
    assert "4.00e-03" in dense and "5.00e-07" in dense
    paged = next(l for l in text.splitlines() if l.strip().startswith("paged"))
    assert "2.00e-03" in paged and "-" in paged
    assert "3 handler calls: 3,000 warp-instructions in 4 s (1 k warp-instructions/s)" in text


def test_an_exported_emulated_library_carries_its_ptx(rng, tmp_path):
    """build(out=...) copies every file the manifest records: an emulated library exported
    without its PTX could not be loaded (CorruptEntry: ...ptx is missing)."""
    spec = KernelSpec(64, "bf16", True, "sm80")
    lib = EmulatedLibrary(build(spec, host="emulate", out=tmp_path / "shipped"))
    assert list((tmp_path / "shipped" / "ptx").glob("*.ptx"))
    assert_matches(Checker(lib, spec, rng).dense(seqlen_q=17, seqlen_k=17, backward=False))
