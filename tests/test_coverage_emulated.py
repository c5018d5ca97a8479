"""The CUDA kernels under emulation on the pairwise covering array (flashgen/coverage.py),
projected onto the specs the other emulated tests build (tests/test_cuda_emulated.py: d64 bf16
causal, d128 f16 and d64 f32 non-causal), so CI builds nothing more.

Projection drops the pairs of head dims, dtypes and causal flags no built spec has (d128 causal,
f32 causal, ...): `python3 -m flashgen.coverage --head-dims 64,128 --specs 64:bf16:causal,128:f16,64:f32`
prints what is kept. Each case runs through the spec's FFI handlers
(flashgen.emulate.check.covering_case: dense with its extras, varlen, paged; forward, and backward
on the emulated forward's o and lse) and every output is held to check.py's tolerances against
float64. Derandomized like tests/test_coverage.py: FLASHGEN_COVERAGE_SEED=<n> draws another array
and other inputs.
"""
import os

import numpy as np
import pytest

from conftest import mutated_csrc, needs_nvcc
from flashgen import coverage, resources
from flashgen.emulate import EmulationError, check
from flashgen.emulate.check import Checker, covering_case
from test_cuda_emulated import checker
from test_variant_mutations import MUTATIONS

pytestmark = needs_nvcc

SEED = int(os.environ.get("FLASHGEN_COVERAGE_SEED", "0"))
SPECS = [(64, "bf16", True), (128, "f16", False), (64, "f32", False)]
DIMS = coverage.space(sorted({s[0] for s in SPECS}))
CASES = coverage.project(coverage.kernel_cases(DIMS["head_dim"], SEED), SPECS)  # as `flashgen check --cases covering`


@pytest.mark.parametrize("index", range(len(CASES)), ids=[str(c) for c in CASES])
def test_covering_case_under_emulation(index):
    case = CASES[index]
    seed = SEED * 1000 + index
    c = checker(np.random.default_rng(seed), case.head_dim, case.dtype, case.causal)
    bad = [r for r in covering_case(c, case).rows if not r.ok]
    assert not bad, f"{case} (FLASHGEN_COVERAGE_SEED={SEED}, input seed {seed}): " + "; ".join(
        f"{r.family} {r.output}: error {r.error:.3g} > {r.tolerance:g}" for r in bad)


# The sm90a family on the covering array over its own subspace (coverage.NATIVE), projected onto
# the two sm90a specs CI builds (tests/test_hopper_emulated.py): every pair of its values on the
# Hopper kernels, not on the sm80 kernels its builds also carry.
HOPPER_SPECS = [(64, "bf16", True), (128, "f16", False)]
HOPPER_DIMS = coverage.space(sorted({s[0] for s in HOPPER_SPECS}), "sm90a")
HOPPER_CASES = coverage.project(coverage.covering_array(HOPPER_DIMS, SEED), HOPPER_SPECS)


@pytest.mark.parametrize("index", range(len(HOPPER_CASES)), ids=[str(c) for c in HOPPER_CASES])
def test_hopper_covering_case_under_emulation(index):
    case = HOPPER_CASES[index]
    seed = SEED * 1000 + index
    c = checker(np.random.default_rng(seed), case.head_dim, case.dtype, case.causal, "sm90a")
    rows = covering_case(c, case).rows
    where = f"{case} (FLASHGEN_COVERAGE_SEED={SEED}, input seed {seed})"
    bad = [r for r in rows if not r.ok]
    assert not bad, f"{where}: " + "; ".join(f"{r.family} {r.output}: error {r.error:.3g} > {r.tolerance:g}" for r in bad)
    served_by_sm80 = {r.kernels for r in rows if "hopper_" not in r.kernels}
    assert not served_by_sm80, f"{where} is in the sm90a family's subspace but ran {served_by_sm80}"


def test_projection_loses_only_pairs_with_a_spec_value():
    """Projection changes only head dim, dtype and causal: every pair of the other dimensions stays."""
    lost = coverage.possible_pairs(DIMS) - coverage.covered_pairs(DIMS, CASES)
    covered, possible = coverage.coverage(DIMS, CASES)
    print(f"{len(CASES)} cases on {len(SPECS)} specs cover {covered}/{possible} pairs; lost: {sorted(lost)}")
    assert {(c.head_dim, c.dtype, c.causal) for c in CASES} == set(SPECS)
    assert lost and all(first in coverage.SPEC_DIMENSIONS for (first, _), _ in lost)


def _failures(spec, lib, cases) -> list[str]:
    """The failing rows of `cases`, or the emulator's own error (a race or a fault is a catch too)."""
    try:
        return [f"{case} {r.output}: {r.error:.3g}" for i, case in cases
                for r in covering_case(Checker(lib, spec, np.random.default_rng(SEED * 1000 + i)), case).rows
                if not r.ok]
    except EmulationError as e:
        return [f"emulator: {e}"]


@pytest.mark.slow
@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_covering_cases_catch_variant_mutation(tmp_path, monkeypatch, mutation):
    """Each spec built from a mutated csrc/ (the planted bugs of tests/test_variant_mutations.py)
    runs its cases, spec after spec until one fails."""
    from flashgen.build import build
    from flashgen.emulate.host import EmulatedLibrary
    from flashgen.spec import KernelSpec
    csrc = mutated_csrc(tmp_path / "csrc", "cuda", mutation)
    monkeypatch.setattr(resources, "csrc_dir", lambda: csrc)
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path / "cache"))
    for head_dim, dtype, causal in SPECS:
        spec = KernelSpec(head_dim, dtype, causal, "sm80")
        cases = [(i, c) for i, c in enumerate(CASES) if (c.head_dim, c.dtype, c.causal) == (head_dim, dtype, causal)]
        failures = _failures(spec, EmulatedLibrary(build(spec, host="emulate")), cases)
        if failures:
            print(f"{mutation[0]}: caught on {spec} by {failures[0]} ({len(failures)} rows)")
            return
    pytest.fail(f"mutation {mutation[0]} survived the covering cases")


def test_check_covering_cases_are_the_array_ci_runs():
    from flashgen.spec import KernelSpec
    got = check.covering_cases([KernelSpec(*s, "sm80") for s in SPECS], SEED)
    assert [case for _, case in got] == CASES
    assert all((s.head_dim, s.dtype, s.causal) == (c.head_dim, c.dtype, c.causal) for s, c in got)


def test_check_covering_cases_on_sm90a_add_the_family_array_and_keep_targets_apart():
    """sm90a specs get the full array (what its builds route to sm80 included) and then the array
    over the Hopper family's subspace; specs of another target in the same call keep their own."""
    from flashgen.spec import KernelSpec
    specs = [KernelSpec(*s, t) for t in ("sm80", "sm90a") for s in HOPPER_SPECS]
    got = check.covering_cases(specs, SEED)
    full = coverage.project(coverage.kernel_cases([64, 128], SEED), HOPPER_SPECS)
    assert [c for s, c in got if s.target == "sm80"] == full
    assert [c for s, c in got if s.target == "sm90a"] == full + HOPPER_CASES
    assert all((s.head_dim, s.dtype, s.causal) == (c.head_dim, c.dtype, c.causal) for s, c in got)
    covered, possible = coverage.coverage(HOPPER_DIMS, HOPPER_CASES)
    print(f"sm90a family: {len(HOPPER_CASES)} cases cover {covered}/{possible} pairs of its subspace")
    assert all((a, b) in {(d, v) for d in HOPPER_DIMS for v in HOPPER_DIMS[d]} for a, b in
               ((k, v) for c in HOPPER_CASES for k, v in c.values))


def test_cli_check_cases_covering_runs_each_spec_its_projected_cases(monkeypatch, capsys):
    """`flashgen check --emulate --cases covering` hands each spec's Checker the cases projected
    onto it (the cases themselves run above; here only which go where)."""
    from flashgen.cli import main
    ran = []
    monkeypatch.setattr(check, "covering_case", lambda c, case: ran.append((c.spec, case)) or check.CaseResult([], []))
    assert main(["check", "--target", "sm80", "--emulate", "--hdim", "64", "--dtype", "f32", "--cases", "covering",
                 "--seed", "3"]) == 0
    want = coverage.project(coverage.kernel_cases([64], 3), [(64, "f32", False)])
    assert [case for _, case in ran] == want and {(s.head_dim, s.dtype, s.causal, s.target) for s, _ in ran} == {(64, "f32", False, "sm80")}
