"""The sm90a dense and varlen backward's Hopper main kernel (csrc/flashgen/cuda/hopper/bwd.cuh: wgmma for
S^T, dP^T, dV, dK and dQ; a producer and a consumer warpgroup per 64 keys) run on the CPU
through its FFI handler, against float64.

Each case builds the sm90a spec as it ships (build(host="emulate")), runs the forward and then
the backward handler under the emulator with fresh random inputs and poisoned outputs, compares
dq, dk and dv with flashgen.reference, and asserts which main kernel ran: the Hopper one for the
dense and varlen calls without extras (softcap included), the sm80 family's for the others. The preprocess and
convert kernels of the sm80 family run around either.
"""
import pytest

from conftest import needs_nvcc
from flashgen.emulate.check import Checker
from flashgen.spec import KernelSpec
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


# Packed sequences (CI: the three cases on the specs CI builds, about 10 s): each case has an empty sequence, ragged lengths, Sq != Sk per sequence and
# padding rows after the last sequence (their gradients 0); bwd_varlen runs on the emulated
# varlen forward's o and lse.
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
    pytest.param(256, "bf16", True, dict(seqlens_q=(30, 0, 70), seqlens_k=(50, 0, 66), bottom_right=True),
                 marks=pytest.mark.slow),
], ids=["d64-bf16-causal-bottom-right-gqa", "d128-f16-window-softcap", "d64-bf16-causal-mqa", "d64-f16-gqa",
        "d128-bf16-causal", "d256-bf16-causal-bottom-right"])
def test_hopper_varlen_backward_matches_float64(rng, head_dim, dtype, causal, case):
    r = backward(rng, head_dim, dtype, causal, layout="varlen", **case)
    assert ran(r, HOPPER_BWD) == 1 and ran(r, SM80_BWD) == 0, r.kernels


# deterministic: the wgmma backward adds dQ in any order, so the sm80 family's fixed-order kernel runs
@pytest.mark.parametrize("case", [dict(alibi="H"), dict(bias=(1, 2)), dict(deterministic=True)],
                         ids=["alibi", "bias-with-dbias", "deterministic"])
def test_calls_it_does_not_serve_keep_the_sm80_kernel(rng, case):
    r = backward(rng, 64, "bf16", True, seqlen_q=50, seqlen_k=70, **case)
    assert ran(r, HOPPER_BWD) == 0 and ran(r, SM80_BWD) == 1, r.kernels


def test_varlen_alibi_keeps_the_sm80_kernel(rng):
    r = backward(rng, 64, "bf16", True, layout="varlen", seqlens_q=(30, 0, 20), seqlens_k=(40, 0, 20), alibi="H")
    assert ran(r, HOPPER_BWD) == 0 and ran(r, SM80_BWD) == 1, r.kernels
