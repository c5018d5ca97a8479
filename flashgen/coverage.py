"""The kernels' feature space and pairwise covering arrays over it.

Bugs live in combinations of features (a softcap in the varlen backward with ALiBi, a
bottom-right offset in the extras kernel), so kernel tests draw their cases from a covering
array: every pair of values of any two dimensions appears in at least one case. The CPU tests
(tests/test_coverage.py) run every case against flashgen.reference in float64; the emulated
CUDA tests (tests/test_coverage_emulated.py) run the array projected onto the specs they build.

Combinations the API refuses are excluded (and tested to be refused): see CONSTRAINTS.

    python3 -m flashgen.coverage [--seed N] [--head-dims 32,64] [--specs 64:bf16:causal,128:f16]

prints the array (projected onto --specs, if given) and the pairs it covers out of those possible.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import random

import numpy as np

# name -> values. The first value of each dimension is the plain one (no feature).
DIMENSIONS: dict[str, tuple] = {
    "dtype": ("f32", "bf16", "f16"),
    "causal": (False, True),
    "bottom_right": (False, True),
    "lengths": ("sq=sk", "sq<sk", "sq>sk", "sq=1", "long"),
    "gqa": (1, 2, 4, "mqa"),
    "window": ("none", "left", "right", "both", "tile"),
    "softcap": (0.0, 5.0),
    "alibi": (None, "H", "BH"),
    "bias": (None, "11", "B1", "1H", "BH", "BH fixed", "BHk"),  # k: [.., 1, Sk], one row for all queries
    "mask": (None, "B1", "1H", "BH"),  # its broadcast dims, as the bias's
    "segment_ids": (False, True),
    "layout": ("dense", "varlen", "paged"),
    "direction": ("fwd", "bwd"),
}

# Concrete values: ragged lengths (no multiple of any tile), windows that cut a tile and one
# that is tile-aligned, a long case whose windows skip whole key blocks on the left. Tails of
# 3 to 45 rows, and of one row short of a full tile (127 and 255 keys, 319 queries: 2^k - 1
# modulo every power-of-two tile up to 128 / 256 / 64 rows), where a tail test off by one
# (`k0 + BC - 1 > Sk`) leaves the one missing key unmasked.
LENGTHS = {"sq=sk": (77, 77), "sq<sk": (45, 131), "sq>sk": (131, 45), "sq=1": (1, 127),
           "long": (319, 255)}
WINDOWS = {"none": (-1, -1), "left": (13, -1), "right": (-1, 9), "both": (16, 5), "tile": (64, 0)}
HEADS_Q = 8
KV_HEADS = {1: 8, 2: 4, 4: 2, "mqa": 1}


def bias_values(rng, shape) -> np.ndarray:
    """A case's bias of `shape` ([.., Sq, Sk], or [.., 1, Sk]: one row all queries share), float64:
    standard normal with -inf, the usual spelling of a mask, at about one entry in ten and over
    the whole of one query row where the rows are the queries' own. That row sees no key through
    its bias alone: o = 0 and lse = -inf (reference.attention), not the NaN of a row whose visible
    scores overflowed, which a kernel that counts a -inf bias as a seen key would give."""
    bias = rng.standard_normal(shape)
    bias[rng.random(shape) < 0.1] = -np.inf
    if shape[-2] > 1:
        bias[..., shape[-2] // 3, :] = -np.inf
    return bias


def alibi_slopes(rng, alibi: str, batch: int, heads_q: int) -> np.ndarray:
    """ALiBi slopes, float32: one per query head ("H") or per batch entry and query head ("BH")."""
    return rng.uniform(0.02, 0.5, (heads_q,) if alibi == "H" else (batch, heads_q)).astype(np.float32)


def extra_operands(rng, *, batch: int, seqlen_q: int, seqlen_k: int, heads_q: int, alibi=None, bias=None,
                   bias_masks=True, mask=None, segment_ids=False) -> dict:
    """A dense case's extra operands, keyed as flashgen.reference.attention takes them, drawn in
    one order so that the CPU tests and the emulated checker (flashgen.emulate.check) make the
    same ones. alibi: "H" | "BH". bias: its broadcast dims ((1 or B, 1 or Hq), then 1 for a
    key-only bias), float64 for the caller to cast; bias_values' masking entries unless not
    bias_masks. mask: its broadcast dims; one query row sees no key. segment_ids: sorted, the
    last query segment without keys."""
    kw = {}
    if alibi:
        kw["alibi_slopes"] = alibi_slopes(rng, alibi, batch, heads_q)
    if bias is not None:
        shape = (*bias, seqlen_k) if len(bias) == 3 else (*bias, seqlen_q, seqlen_k)
        kw["bias"] = bias_values(rng, shape) if bias_masks else rng.standard_normal(shape)
    if mask is not None:
        m = rng.random((*mask, seqlen_q, seqlen_k)) < 0.75
        m[..., seqlen_q // 2, :] = False
        kw["mask"] = m
    if segment_ids:
        qs = np.sort(rng.integers(0, 3, (batch, seqlen_q)), axis=1).astype(np.int32)
        ks = np.sort(rng.integers(0, 3, (batch, seqlen_k)), axis=1).astype(np.int32)
        qs[:, -max(1, seqlen_q // 8):] = 7
        kw.update(q_segment_ids=qs, kv_segment_ids=ks)
    return kw


_DENSE_ONLY = "varlen and paged calls take ALiBi as their only extra operand"
# (dimensions, predicate on their values, why the API refuses a case that fails it)
CONSTRAINTS = (
    (("layout", "bias"), lambda layout, bias: layout == "dense" or bias is None, _DENSE_ONLY),
    (("layout", "mask"), lambda layout, mask: layout == "dense" or not mask, _DENSE_ONLY),
    (("layout", "segment_ids"), lambda layout, seg: layout == "dense" or not seg, _DENSE_ONLY),
    (("layout", "direction"), lambda layout, d: layout != "paged" or d == "fwd",
     "the paged KV cache is forward-only"),
    (("bottom_right", "causal", "window", "alibi"),
     lambda br, causal, window, alibi: not br or causal or window != "none" or alibi is not None,
     "bottom_right only applies to causal attention, a sliding window or ALiBi"),
)


@dataclasses.dataclass(frozen=True)
class Case:
    """One point of the feature space, with the concrete sizes it stands for."""
    values: tuple  # (name, value) pairs in DIMENSIONS order, head_dim first

    def __getattr__(self, name):
        for key, value in object.__getattribute__(self, "values"):
            if key == name:
                return value
        raise AttributeError(name)

    @property
    def seqlens(self) -> tuple[int, int]:
        return LENGTHS[self.lengths]

    @property
    def window_sizes(self) -> tuple[int, int]:
        return WINDOWS[self.window]

    @property
    def heads(self) -> tuple[int, int]:
        return HEADS_Q, KV_HEADS[self.gqa]

    def mask_dims(self, batch: int) -> tuple[int, int] | None:
        """The mask's broadcast dims (1 or batch, 1 or Hq)."""
        return None if self.mask is None else (batch if "B" in self.mask else 1, HEADS_Q if "H" in self.mask else 1)

    def bias_dims(self, batch: int) -> tuple[int, ...] | None:
        """The bias's broadcast dims: (1 or batch, 1 or Hq), then 1 for a key-only bias."""
        if self.bias is None:
            return None
        pattern = self.bias.split()[0]
        return (batch if "B" in pattern else 1, HEADS_Q if "H" in pattern else 1) + ((1,) if "k" in pattern else ())

    @property
    def bias_f32(self) -> bool:
        """A full [B, H, Sq, Sk] bias comes in the inputs' dtype, a broadcast one in f32: both are tested."""
        return self.bias is not None and self.bias.split()[0] != "BH"

    @property
    def bias_differentiated(self) -> bool:
        return self.bias is not None and not self.bias.endswith("fixed")

    def __str__(self):
        return "-".join(f"{k}={v}" for k, v in self.values
                        if v != DIMENSIONS.get(k, (None,))[0] or k in ("head_dim", "dtype", "layout"))


# The values a target's own kernel family serves; every other value is served there by the sm80
# family (csrc/flashgen/cuda/ffi_cuda.cuh: hopper_fwd_supports / hopper_bwd_supports). A covering
# array over this subspace puts every pair of its values on the family's kernels, which the full
# array, mostly cases with an extra, does not; tests/test_coverage_emulated.py asserts that each of
# its cases runs a Hopper kernel, so the subspace cannot claim more than the kernels serve.
NATIVE: dict[str, dict[str, tuple]] = {
    "sm90a": {"dtype": ("bf16", "f16"), "alibi": (None,), "bias": (None,), "mask": (None,),
              "segment_ids": (False,), "layout": ("dense", "varlen")},
}

# The kernels' path without score extras. They dispatch on whether a call has any (ALiBi, bias,
# mask, segment ids), and the full array's cases mostly carry one, so pairs of the other values
# on this path can go untested: a CPU backward without extras that dropped softcap's 1 - u^2, or
# the dS scale, passed the full array. The array over this subspace puts every such pair there.
PLAIN = {"alibi": (None,), "bias": (None,), "mask": (None,), "segment_ids": (False,)}
SUBSPACES = {"plain": PLAIN, **NATIVE}


def space(head_dims, subspace: str | None = None) -> dict[str, tuple]:
    """The feature space over these head dims; with `subspace`, that part of it (SUBSPACES: the
    plain path, or a target family's own)."""
    return {"head_dim": tuple(head_dims), **DIMENSIONS, **SUBSPACES.get(subspace, {})}


def kernel_cases(head_dims, seed: int = 0) -> list[Case]:
    """What the kernel tests run: the array over the full space, then the one over the plain path."""
    return covering_array(space(head_dims), seed) + covering_array(space(head_dims, "plain"), seed)


def refusal(case: dict) -> str | None:
    """Why the API refuses this (possibly partial) assignment, or None. A constraint is
    judged once all of its dimensions are assigned."""
    for dims, ok, why in CONSTRAINTS:
        if all(d in case for d in dims) and not ok(*(case[d] for d in dims)):
            return why
    return None


def _complete(dims, partial: dict) -> dict | None:
    """A valid full case extending `partial` (plain values first), or None."""
    if refusal(partial):
        return None
    free = next((d for d in dims if d not in partial), None)
    if free is None:
        return dict(partial)
    for value in dims[free]:
        found = _complete(dims, {**partial, free: value})
        if found is not None:
            return found
    return None


def _pairs(case: dict):
    return {((a, case[a]), (b, case[b])) for a, b in itertools.combinations(case, 2)}


def possible_pairs(dims) -> set:
    """Pairs of values that some valid case contains (in `dims` order)."""
    return {((a, x), (b, y)) for a, b in itertools.combinations(dims, 2)
            for x in dims[a] for y in dims[b] if _complete(dims, {a: x, b: y}) is not None}


def _ordered(dims, pair_set) -> set:
    order = {d: i for i, d in enumerate(dims)}
    return {tuple(sorted(p, key=lambda kv: order[kv[0]])) for p in pair_set}


def covering_array(dims, seed: int = 0, candidates: int = 12) -> list[Case]:
    """Greedy pairwise covering array (AETG): each new case starts from an uncovered pair and
    assigns the other dimensions, in a random order, the value covering most new pairs."""
    rnd = random.Random(seed)
    uncovered = possible_pairs(dims)
    cases = []
    while uncovered:
        (a, x), (b, y) = min(uncovered, key=repr) if not cases else rnd.choice(sorted(uncovered, key=repr))
        best, gain = None, -1
        for _ in range(candidates):
            case = {a: x, b: y}
            for d in rnd.sample([d for d in dims if d not in case], len(dims) - 2):
                def new(value):
                    trial = {**case, d: value}
                    return len(_ordered(dims, {((d, value), kv) for kv in case.items()}) & uncovered) \
                        if _complete(dims, trial) is not None else -1
                scores = [(new(v), rnd.random(), v) for v in dims[d]]
                case[d] = max(scores, key=lambda s: s[:2])[2]
            covered = len(_ordered(dims, _pairs(case)) & uncovered)
            if covered > gain:
                best, gain = case, covered
        uncovered -= _ordered(dims, _pairs(best))
        cases.append(Case(tuple((d, best[d]) for d in dims)))
    return cases


def covered_pairs(dims, cases) -> set:
    """Pairs of values (in `dims` order) that some case contains."""
    return set().union(*(_ordered(dims, _pairs(dict(c.values))) for c in cases))


def coverage(dims, cases) -> tuple[int, int]:
    """(pairs covered, pairs possible)."""
    possible = possible_pairs(dims)
    return len(covered_pairs(dims, cases) & possible), len(possible)


SPEC_DIMENSIONS = ("head_dim", "dtype", "causal")  # what a built library fixes


def project(cases, specs) -> list[Case]:
    """Each case moved onto the built spec (head_dim, dtype, causal) that agrees with most of
    its values, causal first (it decides which other values are allowed: bottom_right), then
    dtype, then head dim; the other dimensions keep their values."""
    out = []
    for case in cases:
        fits = [dict(zip(SPEC_DIMENSIONS, spec)) for spec in specs]
        fixed = max(fits, key=lambda f: tuple(getattr(case, d) == f[d] for d in ("causal", "dtype", "head_dim")))
        out.append(Case(tuple((d, fixed.get(d, v)) for d, v in case.values)))
    return [c for c in out if refusal(dict(c.values)) is None]  # with no spec of the case's causal flag


def parse_specs(text: str) -> list[tuple]:
    """'64:bf16:causal,128:f16' -> [(64, 'bf16', True), (128, 'f16', False)]."""
    specs = []
    for word in text.split(","):
        head_dim, dtype, *causal = word.split(":")
        if dtype not in DIMENSIONS["dtype"] or causal not in ([], ["causal"]):
            raise ValueError(f"{word!r} is not <head_dim>:<dtype>[:causal]")
        specs.append((int(head_dim), dtype, bool(causal)))
    return specs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m flashgen.coverage", description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=0, help="0 is what CI runs")
    p.add_argument("--head-dims", default="32,64", help="comma-separated (the CPU tests: 32,64)")
    p.add_argument("--subspace", choices=sorted(SUBSPACES),
                   help="the array over a part of the space: the plain path, or a target family's own")
    p.add_argument("--specs", type=parse_specs, help="project onto these built specs, e.g. 64:bf16:causal,128:f16 "
                                   "(the emulated tests'); pairs counted against the full space")
    args = p.parse_args(argv)
    dims = space((int(h) for h in args.head_dims.split(",")), args.subspace)
    cases = covering_array(dims, args.seed)
    if args.specs:
        cases = project(cases, args.specs)
    for case in cases:
        print(case)
    covered, possible = coverage(dims, cases)
    print(f"{len(cases)} cases over {len(dims)} dimensions; pairs covered {covered}/{possible} "
          f"({100 * covered / possible:.1f}%); refused combinations excluded: "
          + "; ".join(sorted({why for _, _, why in CONSTRAINTS})))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
