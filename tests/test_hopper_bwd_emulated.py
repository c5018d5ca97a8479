"""The sm90a dense and varlen backward's Hopper main kernel (csrc/flashgen/cuda/hopper/bwd.cuh: wgmma for
S^T, dP^T, dV, dK and dQ; a producer and a consumer warpgroup per 64 keys) run on the CPU
through its FFI handler, against float64.

Each case builds the sm90a spec as it ships (build(host="emulate")), runs the forward and then
the backward handler under the emulator with fresh random inputs and poisoned outputs, compares
dq, dk and dv with flashgen.reference, and asserts which main kernel ran: the Hopper one for the
dense and varlen calls without extras (softcap included), the sm80 family's for the others. The preprocess and
convert kernels of the sm80 family run around either.
"""
import re

import pytest

from conftest import needs_nvcc
from flashgen.emulate.check import Checker, relative_error, tolerance
from flashgen.spec import KernelSpec
from test_deterministic import SEEDS, _backward, _inputs, _reference
from test_hopper_emulated import _library, ran

pytestmark = needs_nvcc

HOPPER_BWD = "hopper_bwd_kernel"
SM80_BWD = "flash_bwd_kernel"


def backward(rng, head_dim, dtype, causal, layout="dense", **case):
    spec = KernelSpec(head_dim, dtype, causal, "sm90a")
    result = getattr(Checker(_library(spec), spec, rng), layout)(**case)
    bad = [r for r in result.rows if not r.ok]
    assert not bad, "\n".join(f"{r.spec} [{r.case}] {r.output}: error {r.error:.3g} > {r.tolerance:g}" for r in bad)
    for r in result.rows:
        print(f"{r.spec} [{r.case}] {r.output}: error {r.error:.2e} ({r.seconds:.1f} s, {r.warp_instructions} warp-instructions)")
    assert {r.output for r in result.rows} >= {"dq", "dk", "dv"}
    return result


# CI runs the two sm90a specs test_cuda_build compiles (d64 bf16 causal, d128 f16); the other
# specs cost a build each (about a minute on 2 cores) and are marked slow.
@pytest.mark.parametrize("head_dim,dtype,causal,case", [
    # GQA (dK / dV added over the group's q heads in f32), ragged Sq < Sk: causal skips query
    # blocks and masks the diagonal and tail ones
    (64, "bf16", True, dict(batch=2, seqlen_q=77, seqlen_k=130, heads_q=4, heads_kv=2)),
    # bottom-right, Sq > Sk: the first 53 rows see no key (lse = -inf, their dq 0); no GQA: dK / dV
    # stored straight in the output type
    (64, "bf16", True, dict(seqlen_q=130, seqlen_k=77, heads_q=2, heads_kv=2, bottom_right=True)),
    (128, "f16", False, dict(seqlen_q=65, seqlen_k=100, heads_q=2, heads_kv=1)),
    # softcap (dS times 1 - tanh^2) inside a causal sliding window: key blocks see both band edges
    (64, "bf16", True, dict(seqlen_q=100, seqlen_k=130, heads_q=2, heads_kv=1, window=(40, -1), softcap=2.0)),
    pytest.param(64, "f16", False, dict(seqlen_q=70, seqlen_k=150, heads_q=3, heads_kv=1), marks=pytest.mark.slow),
    pytest.param(128, "bf16", True, dict(seqlen_q=100, seqlen_k=70, heads_q=2, heads_kv=2), marks=pytest.mark.slow),
    pytest.param(256, "bf16", True, dict(seqlen_q=70, seqlen_k=90, heads_q=2, heads_kv=1), marks=pytest.mark.slow),
    pytest.param(128, "f16", False, dict(seqlen_q=70, seqlen_k=90, window=(8, 5)), marks=pytest.mark.slow),
    pytest.param(128, "f16", False, dict(seqlen_q=70, seqlen_k=90, window=(8, 5), softcap=1.5), marks=pytest.mark.slow),
], ids=["d64-bf16-causal-gqa", "d64-bf16-bottom-right-sq>sk-mha", "d128-f16-mqa", "d64-bf16-causal-window-softcap",
        "d64-f16-mqa", "d128-bf16-causal", "d256-bf16-causal", "d128-f16-window", "d128-f16-window-softcap"])
def test_hopper_backward_matches_float64(rng, head_dim, dtype, causal, case):
    r = backward(rng, head_dim, dtype, causal, **case)
    assert ran(r, HOPPER_BWD) == 1 and ran(r, SM80_BWD) == 0, r.kernels


# Packed sequences (CI: the three cases on the specs CI builds, about 10 s, and d256): each case
# has an empty sequence, ragged lengths, Sq != Sk per sequence and padding rows after the last
# sequence (their gradients 0); bwd_varlen runs on the emulated varlen forward's o and lse.
@pytest.mark.parametrize("head_dim,dtype,causal,case", [
    # bottom-right causal, GQA: the 23 queries of the last sequence see its 17 keys from row 6 on
    # (rows 0-5 see none); the first sequence's 90 keys span 2 key blocks, the second one's block
    # reads past its keys into the next sequence's rows (masked)
    (64, "bf16", True, dict(seqlens_q=(70, 0, 23), seqlens_k=(90, 0, 17), pad_q=5, pad_k=3, bottom_right=True,
                            heads_q=4, heads_kv=2)),
    # window + softcap, no GQA (dK / dV stored straight into the output, padding rows zeroed)
    (128, "f16", False, dict(seqlens_q=(65, 0, 30), seqlens_k=(20, 0, 100), window=(20, 10), softcap=1.5,
                             heads_q=2, heads_kv=2)),
    # top-left causal, Sq > Sk in the first sequence, MQA
    (64, "bf16", True, dict(seqlens_q=(100, 0, 33), seqlens_k=(70, 0, 80), pad_q=2, pad_k=0, heads_q=3, heads_kv=1)),
    pytest.param(64, "f16", False, dict(seqlens_q=(0, 50, 77), seqlens_k=(10, 0, 130), heads_q=2, heads_kv=1),
                 marks=pytest.mark.slow),
    pytest.param(128, "bf16", True, dict(seqlens_q=(40, 0, 90), seqlens_k=(70, 0, 65), heads_q=2, heads_kv=1),
                 marks=pytest.mark.slow),
    # head dim above 128: each CTA owns one column half of dK / dV / dQ (the only CI case of
    # that split; its spec is built for it, ~30 s)
    (256, "bf16", True, dict(seqlens_q=(30, 0, 70), seqlens_k=(50, 0, 66), bottom_right=True)),
], ids=["d64-bf16-causal-bottom-right-gqa", "d128-f16-window-softcap", "d64-bf16-causal-mqa", "d64-f16-gqa",
        "d128-bf16-causal", "d256-bf16-causal-bottom-right"])
def test_hopper_varlen_backward_matches_float64(rng, head_dim, dtype, causal, case):
    r = backward(rng, head_dim, dtype, causal, layout="varlen", **case)
    assert ran(r, HOPPER_BWD) == 1 and ran(r, SM80_BWD) == 0, r.kernels


@pytest.mark.parametrize("case", [dict(alibi="H"), dict(bias=(1, 2))], ids=["alibi", "bias-with-dbias"])
def test_calls_it_does_not_serve_keep_the_sm80_kernel(rng, case):
    r = backward(rng, 64, "bf16", True, seqlen_q=50, seqlen_k=70, **case)
    assert ran(r, HOPPER_BWD) == 0 and ran(r, SM80_BWD) == 1, r.kernels


def test_varlen_alibi_keeps_the_sm80_kernel(rng):
    r = backward(rng, 64, "bf16", True, layout="varlen", seqlens_q=(30, 0, 20), seqlens_k=(40, 0, 20), alibi="H")
    assert ran(r, HOPPER_BWD) == 0 and ran(r, SM80_BWD) == 1, r.kernels


# ---- deterministic=True: the wgmma kernel's DET form (fixed-order dQ, GQA dK / dV) ----------------
# Two emulator schedules (test_deterministic.SEEDS: the order CTAs run, warps interleave and
# atomics land) give the same bits, and match float64. Causal, 150 x 150, 3 q heads per kv head:
# query block 2's dQ takes the shares of 3 key blocks, each dK / dV element those of 3 q heads.
# bf16 rounding hides most f32 reorderings, so the inputs make the heads' dK / dV shares cancel:
# q head 1 = q head 0 and dO head 1 = -dO head 0 = 2^24 x N(0, 1) give shares A, -A (exactly:
# every step of the kernel is odd in dO) and C from head 2; in head order the sum is exactly C,
# in another order C plus a rounding error of A that bf16 shows.
DET_SPEC, DET_SHAPE = KernelSpec(64, "bf16", True, "sm90a"), dict(sq=150, sk=150, hq=3, hkv=1)


def _cancelling_inputs(rng):
    q, k, v, do, extras, window = _inputs(rng, DET_SPEC, **DET_SHAPE)
    q[:, :, 1] = q[:, :, 0]
    do[:, :, 0] *= 2 ** 24
    do[:, :, 1] = -do[:, :, 0]
    return q, k, v, do, extras, window


def _det_flags(entries) -> list[str]:
    """The DET template argument of each hopper_bwd_kernel launch among `entries` (its last: Lb<0|1>E)."""
    return [re.search(r"Lb([01])EEEv", k).group(1) for k in entries if f"{len(HOPPER_BWD)}{HOPPER_BWD}I" in k]


def test_deterministic_backward_is_the_same_bits_under_two_schedules(rng):
    inputs = _cancelling_inputs(rng)
    runs, records = zip(*(_backward(DET_SPEC, inputs, seed=s, deterministic=True) for s in SEEDS))
    assert [_det_flags(l.entry for l in r.launches) for r in records] == [["1"], ["1"]]  # the wgmma kernel's DET form, not sm80
    for name, a, b, ref in zip(("dq", "dk", "dv"), *runs, _reference(DET_SPEC, inputs)):
        assert a.tobytes() == b.tobytes(), f"{name} differs between schedules {SEEDS}"
        assert relative_error(a, ref) <= tolerance(DET_SPEC.dtype, name), (name, relative_error(a, ref))


def test_default_backward_depends_on_the_schedule(rng):
    """What the DET form fixes: on the same inputs the default wgmma kernel's dK / dV (the q
    heads' shares in whatever order their atomics land) are different bits under the two
    schedules."""
    inputs = _cancelling_inputs(rng)
    runs, records = zip(*(_backward(DET_SPEC, inputs, seed=s, deterministic=False) for s in SEEDS))
    assert [_det_flags(l.entry for l in r.launches) for r in records] == [["0"], ["0"]]
    assert runs[0][1].tobytes() != runs[1][1].tobytes() or runs[0][2].tobytes() != runs[1][2].tobytes()


# The DET form's turns under a band (each query block's order runs over exactly the key blocks
# that visit it: a turn nobody passes would hang until the emulator's instruction budget) and
# per sequence (an empty one, key blocks past a sequence's end), against float64.
@pytest.mark.parametrize("head_dim,dtype,causal,layout,case", [
    (64, "bf16", True, "dense", dict(seqlen_q=150, seqlen_k=200, heads_q=2, heads_kv=1, window=(40, -1),
                                     softcap=2.0)),
    (64, "bf16", True, "varlen", dict(seqlens_q=(70, 0, 33), seqlens_k=(40, 0, 140), bottom_right=True, heads_q=3,
                                      heads_kv=1)),
    pytest.param(128, "f16", False, "varlen", dict(seqlens_q=(150, 0, 40), seqlens_k=(130, 0, 100), window=(30, 50),
                                                   heads_q=2, heads_kv=2), marks=pytest.mark.slow),
], ids=["dense-causal-window-softcap-gqa", "varlen-bottom-right-gqa", "varlen-d128-window"])
def test_deterministic_bands_and_varlen_match_float64(rng, head_dim, dtype, causal, layout, case):
    r = backward(rng, head_dim, dtype, causal, layout=layout, deterministic=True, **case)
    assert _det_flags(r.kernels) == ["1"], r.kernels
