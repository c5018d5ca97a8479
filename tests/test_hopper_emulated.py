"""The sm90a dense forward's Hopper kernel (csrc/flashgen/cuda/hopper/: wgmma, TMA loads into an
mbarrier ring, a producer and two ping-ponging consumer warpgroups, setmaxnreg) run on the CPU
through its FFI handler (which encodes the TMA maps), against float64.

Each case builds the sm90a spec as it ships (build(host="emulate")), calls the forward handler
under the emulator with fresh random inputs and poisoned outputs, compares o and lse with
flashgen.reference, and asserts which kernel ran: the Hopper one for the calls it serves
(hopper_fwd_supports), the sm80 family's for the others.
"""
import functools

import pytest

from conftest import needs_nvcc
from flashgen.build import build
from flashgen.emulate.check import Checker
from flashgen.emulate.host import EmulatedLibrary
from flashgen.spec import KernelSpec

pytestmark = needs_nvcc

HOPPER_FWD = "hopper_fwd_kernel"
SM80_FWD = "flash_fwd_kernel"


@functools.cache
def _library(spec: KernelSpec) -> EmulatedLibrary:
    return EmulatedLibrary(build(spec, host="emulate"))


def forward(rng, head_dim, dtype, causal, **case):
    spec = KernelSpec(head_dim, dtype, causal, "sm90a")
    result = Checker(_library(spec), spec, rng).dense(backward=False, **case)
    bad = [r for r in result.rows if not r.ok]
    assert not bad, "\n".join(f"{r.spec} [{r.case}] {r.output}: error {r.error:.3g} > {r.tolerance:g}" for r in bad)
    for r in result.rows:
        print(f"{r.spec} [{r.case}] {r.output}: error {r.error:.2e} ({r.seconds:.1f} s, {r.warp_instructions} warp-instructions)")
    return result


def ran(result, kernel: str) -> int:
    """Launches of template `kernel` in the case (its mangled name has `<length><name>I`)."""
    return sum(f"{len(kernel)}{kernel}I" in k for k in result.kernels)


# CI builds only the two sm90a specs test_cuda_build compiles (d64 bf16 causal, d128 f16); the
# other specs cost a build each (about a minute on 2 cores) and are marked slow. An emulated case
# takes 10-30 s (2 cores under load): CI runs one per feature, the others are marked slow.
SLOW = pytest.mark.slow


@pytest.mark.parametrize("head_dim,dtype,causal,case", [
    # ragged lengths (no tile multiple), Sq != Sk both ways, GQA, batch > 1; causal skips and masks blocks
    (64, "bf16", True, dict(batch=2, seqlen_q=77, seqlen_k=130, heads_q=2, heads_kv=1)),
    pytest.param(64, "bf16", True, dict(seqlen_q=130, seqlen_k=45, heads_q=2, heads_kv=1), marks=SLOW),
    pytest.param(128, "f16", False, dict(seqlen_q=65, seqlen_k=100, heads_q=2, heads_kv=1), marks=SLOW),
    pytest.param(64, "bf16", False, dict(seqlen_q=70, seqlen_k=150, heads_q=3, heads_kv=1), marks=SLOW),
    pytest.param(128, "bf16", True, dict(seqlen_q=100, seqlen_k=70, heads_q=2, heads_kv=2), marks=SLOW),
    pytest.param(256, "bf16", True, dict(seqlen_q=70, seqlen_k=90, heads_q=2, heads_kv=1), marks=SLOW),
], ids=["d64-bf16-causal-gqa", "d64-bf16-causal-sq>sk", "d128-f16", "d64-bf16-mqa", "d128-bf16-causal",
        "d256-bf16-causal"])
def test_hopper_forward_matches_float64(rng, head_dim, dtype, causal, case):
    r = forward(rng, head_dim, dtype, causal, **case)
    assert ran(r, HOPPER_FWD) == 1 and ran(r, SM80_FWD) == 0, r.kernels


def test_no_keys_gives_zero_and_minus_inf(rng):
    # Sk = 0: the kernel loads nothing, every row writes o = 0, lse = -inf (poisoned before).
    r = forward(rng, 64, "bf16", True, seqlen_q=40, seqlen_k=0)
    assert ran(r, HOPPER_FWD) == 1


@pytest.mark.parametrize("head_dim,dtype,causal,case", [
    # softcap with bottom-right causal (the first 52 rows see no key: o = 0, lse = -inf), GQA
    (64, "bf16", True, dict(seqlen_q=129, seqlen_k=77, softcap=2.0, bottom_right=True, heads_q=2, heads_kv=1)),
    # softcap with a window, GQA, Sq > Sk, ragged (softcap 0 < c < max |score|: the cap bites)
    (128, "f16", False, dict(seqlen_q=130, seqlen_k=97, window=(40, 30), softcap=1.5, heads_q=2, heads_kv=1)),
    pytest.param(64, "bf16", True, dict(seqlen_q=129, seqlen_k=77, bottom_right=True), marks=SLOW),
    pytest.param(64, "bf16", True, dict(seqlen_q=150, seqlen_k=150, window=(24, 0)), marks=SLOW),
    pytest.param(128, "f16", False, dict(seqlen_q=70, seqlen_k=90, window=(8, 5), heads_q=2, heads_kv=1), marks=SLOW),
    pytest.param(64, "bf16", True, dict(seqlen_q=90, seqlen_k=200, softcap=2.0, bottom_right=True, heads_q=3,
                                        heads_kv=1), marks=SLOW),
    pytest.param(256, "bf16", True, dict(seqlen_q=70, seqlen_k=90, softcap=2.0, heads_q=2, heads_kv=2), marks=SLOW),
    pytest.param(128, "bf16", True, dict(seqlen_q=140, seqlen_k=140, window=(30, 0), softcap=5.0, heads_q=2,
                                         heads_kv=1), marks=SLOW),
    pytest.param(64, "f16", False, dict(seqlen_q=33, seqlen_k=190, softcap=1.0, heads_q=4, heads_kv=1), marks=SLOW),
], ids=["d64-bf16-bottom-right-softcap-empty-rows", "d128-f16-window-softcap-gqa", "d64-bottom-right-empty-rows",
        "d64-causal-window", "d128-window", "d64-bf16-bottom-right-softcap-mqa", "d256-bf16-causal-softcap",
        "d128-bf16-window-softcap", "d64-f16-softcap-mqa"])
def test_bands(rng, head_dim, dtype, causal, case):
    r = forward(rng, head_dim, dtype, causal, **case)
    assert ran(r, HOPPER_FWD) == 1 and ran(r, SM80_FWD) == 0, r.kernels


def varlen_forward(rng, head_dim, dtype, causal, **case):
    spec = KernelSpec(head_dim, dtype, causal, "sm90a")
    result = Checker(_library(spec), spec, rng).varlen(backward=False, **case)
    bad = [r for r in result.rows if not r.ok]
    assert not bad, "\n".join(f"{r.spec} [{r.case}] {r.output}: error {r.error:.3g} > {r.tolerance:g}" for r in bad)
    return result


@pytest.mark.parametrize("head_dim,dtype,causal,case", [
    # ragged sequences around an empty one, padding rows after the last (o = 0, lse = -inf), GQA,
    # bottom-right causal with Sq < Sk and Sq > Sk: 70 rows end inside consumer 1's tile (its O
    # clipped), 23 rows inside consumer 0's; every Q / K box runs into the next sequence
    (64, "bf16", True, dict(seqlens_q=(70, 0, 23), seqlens_k=(90, 0, 17), pad_q=5, pad_k=3, bottom_right=True)),
    pytest.param(64, "bf16", True, dict(seqlens_q=(33, 80), seqlens_k=(50, 70), pad_q=2, pad_k=0, heads_q=3,
                                        heads_kv=1), marks=SLOW),
    pytest.param(128, "f16", False, dict(seqlens_q=(65, 0, 30), seqlens_k=(20, 0, 100), window=(20, 10), softcap=1.5,
                                         heads_q=2, heads_kv=1), marks=SLOW),
], ids=["d64-bf16-causal-bottom-right-empty-padding", "d64-bf16-causal-mqa", "d128-f16-window-softcap"])
def test_varlen_matches_float64(rng, head_dim, dtype, causal, case):
    r = varlen_forward(rng, head_dim, dtype, causal, **case)
    assert ran(r, HOPPER_FWD) == 1 and ran(r, SM80_FWD) == 0, r.kernels


def test_calls_it_does_not_serve_keep_the_sm80_kernel(rng):
    # an extra the wgmma kernel does not port (ALiBi): the sm80 family's kernel, still correct
    r = forward(rng, 64, "bf16", True, seqlen_q=50, seqlen_k=70, alibi="H")
    assert ran(r, HOPPER_FWD) == 0 and ran(r, SM80_FWD) == 1, r.kernels
    r = varlen_forward(rng, 64, "bf16", True, seqlens_q=(30, 20), alibi="H")
    assert ran(r, HOPPER_FWD) == 0 and ran(r, SM80_FWD) == 1, r.kernels
