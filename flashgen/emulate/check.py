"""Check a CUDA spec's kernels on the CPU: its FFI handlers run under emulation
(flashgen.emulate.host) on fresh random inputs, compared with the float64 reference.

Each case draws its inputs, calls the handlers as XLA would (the backward gets the
emulated forward's o and lse), and returns one Row per output: the largest error
relative to max(1, max|reference|), where a non-finite value must match the reference
exactly (-inf lse of a row without keys; a NaN never passes). `flashgen check --emulate`
runs standard_cases() (or, with --cases covering, covering_cases()) and prints the table. Emulation shows correctness, never speed.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import ml_dtypes
import numpy as np

from flashgen import coverage, reference, targets
from flashgen.contract import CallAttributes, normalize_extras
from flashgen.emulate import counters
from flashgen.emulate.machine import short_name
from flashgen.spec import KernelSpec

NP_DTYPES = {"bf16": ml_dtypes.bfloat16, "f16": np.float16, "f32": np.float32}
# Relative error allowed per element type: a few units in the last place of the
# output type (bf16 8 bits, f16 11 bits; f32 goes through 3xTF32 MMAs). The largest
# errors of the recorded sweep (bench/results/emulated-*-2026-11-27.json: 30 specs, every
# family, sm80 and sm90a) were 8.3e-3 (a varlen dq), 7.3e-4, 9.8e-7.
TOLERANCE = {"bf16": 1.5e-2, "f16": 2e-3, "f32": 1e-5}
# lse is f32 in every spec and computed from f32 scores whatever the inputs' type: its errors
# are f32 rounding (~1e-7), so the output type's tolerance would let a 1% error through.
LSE_TOLERANCE = 1e-5


def tolerance(dtype: str, output: str) -> float:
    return LSE_TOLERANCE if output == "lse" else TOLERANCE[dtype]


@dataclasses.dataclass(frozen=True)
class Row:
    family: str
    spec: str
    case: str
    output: str
    error: float
    tolerance: float
    seconds: float      # of the handler call that produced the output
    warp_instructions: int  # executed by that call's launches (the emulator's work)
    call: int           # which of the Checker's handler calls produced it (rows share calls)
    kernels: str        # the kernels that call launched ("+"-joined): which family served it
    # per kernel of that call: its launches' emulated counters (counters.summary), never speed
    counters: dict = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error <= self.tolerance


@dataclasses.dataclass
class CaseResult:
    rows: list[Row]
    kernels: list[str]  # the PTX entry of every launch of the case, in order


def relative_error(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if got.shape != ref.shape:
        raise ValueError(f"shape {got.shape} != reference {ref.shape}")
    finite = np.isfinite(ref)
    if not np.array_equal(got[~finite], ref[~finite]) or not np.isfinite(got[finite]).all():
        return float("inf")
    if not finite.any():
        return 0.0
    return float(np.abs(got[finite] - ref[finite]).max() / max(1.0, np.abs(ref[finite]).max()))


class Checker:
    """Runs cases of one spec through an EmulatedLibrary."""

    def __init__(self, library, spec: KernelSpec, rng: np.random.Generator, *, seed: int | None = None):
        self.lib, self.spec, self.rng, self.seed = library, spec, rng, seed
        self.calls = 0
        self.dt = NP_DTYPES[spec.dtype]
        self.scale = float(np.float32(1 / np.sqrt(spec.head_dim)))

    def _attrs(self, bottom_right, window, softcap, extras=(), max_seqlen=None, deterministic=False) -> CallAttributes:
        return CallAttributes(self.spec.causal, self.scale, bottom_right, window, softcap, extras, max_seqlen,
                              deterministic)

    def _normal(self, *shape):
        return self.rng.standard_normal(shape).astype(self.dt)

    def _rows(self, family, case, record, pairs):
        instructions = sum(l.stats.warp_instructions for l in record.launches)
        names = [short_name(l.entry).split("[")[0] for l in record.launches]
        kernels = "+".join(dict.fromkeys(names))
        counts = {k: counters.summary([l.stats for l, n in zip(record.launches, names) if n == k])
                  for k in dict.fromkeys(names)}
        self.calls += 1
        return [Row(family, self.spec.stem, case, name, relative_error(got, ref), tolerance(self.spec.dtype, name),
                    record.seconds, instructions, self.calls, kernels, counts) for name, got, ref in pairs]

    def _run(self, family, case, target, operands, results, attrs, pairs_of, kernels):
        """Call `target`; pairs_of(outputs) -> [(name, got, ref)]; returns (outputs, rows)."""
        outs, rec = self.lib.call(target, operands, results, seed=self.seed, **attrs)
        kernels += [l.entry for l in rec.launches]
        return outs, self._rows(family, case, rec, pairs_of(outs))

    # -----------------------------------------------------------------------------------------
    def dense(self, *, batch=1, seqlen_q=77, seqlen_k=None, heads_q=2, heads_kv=1, bottom_right=False,
              window=(-1, -1), softcap=0.0, alibi=None, bias=None, bias_f32=False, bias_grad=True,
              bias_masks=False, mask=None, segment_ids=False, backward=True, deterministic=False) -> CaseResult:
        """Dense forward (and backward, on the emulated forward's o and lse; deterministic: its
        fixed-order kernels).
        The extras are coverage.extra_operands' (alibi, bias, mask, segment_ids and bias_masks as
        it takes them); the bias is differentiated (the backward returns dbias, checked) unless not
        bias_grad."""
        b, sq, hq, hkv, d, dv = batch, seqlen_q, heads_q, heads_kv, self.spec.head_dim, self.spec.head_dim_v
        sk = sq if seqlen_k is None else seqlen_k
        q, k, v, do = (self._normal(b, n, h, e) for n, h, e in ((sq, hq, d), (sk, hkv, d), (sk, hkv, dv), (sq, hq, dv)))
        kw = coverage.extra_operands(self.rng, batch=b, seqlen_q=sq, seqlen_k=sk, heads_q=hq, alibi=alibi,
                                     bias=bias, bias_masks=bias_masks, mask=mask, segment_ids=segment_ids)
        if bias is not None:
            kw["bias"] = kw["bias"].astype(np.float32 if bias_f32 else self.dt)
        ops = {name: [kw[key] for key in keys] for name, keys in _EXTRA_KEYS.items() if keys[0] in kw}
        names = normalize_extras(tuple(ops))
        extra_ops = [a for n in names for a in ops[n]]
        attrs = self._attrs(bottom_right, window, softcap, names, deterministic=deterministic)
        family = "extras" if names else "dense"
        case = _describe(b=b, sq=sq, sk=sk, hq=hq, hkv=hkv, bottom_right=bottom_right, window=window,
                         softcap=softcap, alibi=alibi,
                         bias=bias and f"{bias}{':f32' if bias_f32 else ''}{'' if bias_grad else ':fixed'}"
                                      f"{':-inf' if bias_masks else ''}",
                         mask=mask, segment_ids=segment_ids)
        ref = reference.attention(q, k, v, causal=self.spec.causal, scale=self.scale, bottom_right=bottom_right,
                                  window=window, softcap=softcap, do=do if backward else None, **kw)
        kernels: list[str] = []
        (o, lse), rows = self._run(family, case, self.spec.target_name("fwd"), [q, k, v, *extra_ops],
                                   [((b, sq, hq, dv), self.dt), ((b, hq, sq), np.float32)], attrs.values("fwd"),
                                   lambda out: [("o", out[0], ref[0]), ("lse", out[1], ref[1])], kernels)
        if backward:
            results = [((b, sq, hq, d), self.dt), ((b, sk, hkv, d), self.dt), ((b, sk, hkv, dv), self.dt)]
            if bias is not None and bias_grad:  # dbias: the bias's shape and type
                results.append((ops["bias"][0].shape, ops["bias"][0].dtype))
            _, more = self._run(family, case, self.spec.target_name("bwd"), [q, k, v, o, lse, do, *extra_ops],
                                results, attrs.values("bwd"),
                                lambda out: list(zip(("dq", "dk", "dv", "dbias"), out, ref[2])), kernels)
            rows += more
        return CaseResult(rows, kernels)

    def varlen(self, *, seqlens_q=(17, 0, 40), seqlens_k=None, pad_q=3, pad_k=2, heads_q=2, heads_kv=1,
               bottom_right=False, window=(-1, -1), softcap=0.0, alibi=None, backward=True,
               deterministic=False) -> CaseResult:
        """Packed variable-length batch; `pad_q` / `pad_k` rows after the last sequence
        belong to none (o = 0, lse = -inf, zero gradients)."""
        seqlens_k = seqlens_q if seqlens_k is None else seqlens_k
        hq, hkv, d = heads_q, heads_kv, self.spec.head_dim
        cu_q = np.concatenate([[0], np.cumsum(seqlens_q)]).astype(np.int32)
        cu_k = np.concatenate([[0], np.cumsum(seqlens_k)]).astype(np.int32)
        tq, tk = int(cu_q[-1]) + pad_q, int(cu_k[-1]) + pad_k
        q, k, v, do = (self._normal(n, h, d) for n, h in ((tq, hq), (tk, hkv), (tk, hkv), (tq, hq)))
        kw, extra_ops = {}, []
        if alibi:
            extra_ops = [coverage.alibi_slopes(self.rng, alibi, len(seqlens_q), hq)]
            kw["alibi_slopes"] = extra_ops[0]
        attrs = self._attrs(bottom_right, window, softcap, "alibi" if alibi else "", (max(seqlens_q), max(seqlens_k)),
                            deterministic)
        case = _describe(seqlens_q=tuple(seqlens_q), seqlens_k=tuple(seqlens_k), pad=(pad_q, pad_k), hq=hq,
                         hkv=hkv, bottom_right=bottom_right, window=window, softcap=softcap, alibi=alibi)
        ref = reference.attention_varlen(q, k, v, cu_q, cu_k, causal=self.spec.causal, scale=self.scale,
                                         bottom_right=bottom_right, window=window, softcap=softcap,
                                         do=do if backward else None, **kw)
        kernels: list[str] = []
        (o, lse), rows = self._run("varlen", case, self.spec.target_name("fwd_varlen"),
                                   [q, k, v, cu_q, cu_k, *extra_ops], [((tq, hq, d), self.dt), ((hq, tq), np.float32)],
                                   attrs.values("fwd_varlen"), lambda out: [("o", out[0], ref[0]), ("lse", out[1], ref[1])],
                                   kernels)
        if backward:
            _, more = self._run("varlen", case, self.spec.target_name("bwd_varlen"),
                                [q, k, v, o, lse, do, cu_q, cu_k, *extra_ops],
                                [((tq, hq, d), self.dt), ((tk, hkv, d), self.dt), ((tk, hkv, d), self.dt)],
                                attrs.values("bwd_varlen"),
                                lambda out: list(zip(("dq", "dk", "dv"), out, ref[2])), kernels)
            rows += more
        return CaseResult(rows, kernels)

    def paged(self, *, seqused_k=(300, 0, 41), seqlen_q=1, block_size=16, heads_q=2, heads_kv=1, spare_blocks=2,
              bottom_right=None, window=(-1, -1), softcap=0.0, alibi=None) -> CaseResult:
        """Paged-KV forward (decode): a shuffled block table over a cache with spare
        blocks, table rows longer than seqused_k. Split-KV and its combine kernel run when
        the handler chooses them (CaseResult.kernels says). bottom_right defaults to the
        spec's causal flag (decode alignment)."""
        b, hq, hkv, d, bs = len(seqused_k), heads_q, heads_kv, self.spec.head_dim, block_size
        bottom_right = self.spec.causal if bottom_right is None else bottom_right
        max_blocks = max(1, -(-max(seqused_k) // bs)) + 1
        num_blocks = b * max_blocks + spare_blocks
        table = self.rng.permutation(num_blocks)[:b * max_blocks].reshape(b, max_blocks).astype(np.int32)
        q = self._normal(b, seqlen_q, hq, d)
        kc, vc = self._normal(num_blocks, bs, hkv, d), self._normal(num_blocks, bs, hkv, d)
        used = np.asarray(seqused_k, np.int32)
        kw, extra_ops = {}, []
        if alibi:
            extra_ops = [coverage.alibi_slopes(self.rng, alibi, b, hq)]
            kw["alibi_slopes"] = extra_ops[0]
        attrs = self._attrs(bottom_right, window, softcap, "alibi" if alibi else "").values("fwd_paged")
        case = _describe(seqused_k=tuple(seqused_k), sq=seqlen_q, block_size=bs, hq=hq, hkv=hkv,
                         bottom_right=bottom_right, window=window, softcap=softcap, alibi=alibi)
        ref = reference.attention_paged(q, kc, vc, table, used, causal=self.spec.causal, scale=self.scale,
                                        bottom_right=bottom_right, window=window, softcap=softcap, **kw)
        kernels: list[str] = []
        _, rows = self._run("paged", case, self.spec.target_name("fwd_paged"), [q, kc, vc, table, used, *extra_ops],
                            [((b, seqlen_q, hq, d), self.dt), ((b, hq, seqlen_q), np.float32)], attrs,
                            lambda out: [("o", out[0], ref[0]), ("lse", out[1], ref[1])], kernels)
        if any("24flash_fwd_combine_kernelI" in k for k in kernels):  # the handler chose split-KV
            rows = [dataclasses.replace(r, case=r.case + " split-KV") for r in rows]
        return CaseResult(rows, kernels)


# each extra operand's name in a call (contract.normalize_extras) -> its keywords in reference.attention
_EXTRA_KEYS = {"alibi": ("alibi_slopes",), "bias": ("bias",), "mask": ("mask",),
               "segment_ids": ("q_segment_ids", "kv_segment_ids")}


def _describe(**kw) -> str:
    """A case's parameters that differ from the defaults, as `key=value` words."""
    return " ".join(k if v is True else f"{k}={v}" for k, v in kw.items()
                    if v not in (False, None, "", 0.0, (-1, -1)) or k in ("sq", "sk"))


def standard_cases(c: Checker) -> list[CaseResult]:
    """What `flashgen check --emulate` runs: every entry point of the spec, small shapes that
    combine the features where bugs hide (tile tails, Sq != Sk with bottom-right alignment in
    every family that takes extras, GQA ratios above 2 with more than 2 KV heads, each broadcast
    of a mask and of a bias over batch and heads, ALiBi with softcap in varlen, ALiBi in paged,
    windows that skip key blocks on the left, rows without keys, an empty sequence, split-KV)."""
    causal = c.spec.causal
    right = 0 if causal else 8
    return [
        c.dense(seqlen_q=77, seqlen_k=129, heads_q=2, heads_kv=1, bottom_right=causal),
        c.dense(seqlen_q=70, seqlen_k=90, window=(16, right), softcap=3.0),
        c.dense(seqlen_q=300, seqlen_k=260, window=(40, right), bottom_right=True),
        c.dense(seqlen_q=260, seqlen_k=300, window=(40, right), backward=False),
        c.dense(batch=2, seqlen_q=33, seqlen_k=40, heads_q=6, heads_kv=3, bottom_right=True, softcap=2.0,
                alibi="BH", bias=(1, 6), bias_masks=True, mask=(2, 1), segment_ids=True),
        # the other broadcasts: a mask per head for both batch entries, an f32 key-only bias per batch entry
        c.dense(batch=2, seqlen_q=45, seqlen_k=37, heads_q=4, heads_kv=2, window=(20, right), bias=(2, 1, 1),
                bias_f32=True, bias_masks=True, mask=(1, 4)),
        c.varlen(seqlens_q=(17, 0, 40), seqlens_k=(23, 5, 31), heads_q=9, heads_kv=3, bottom_right=True,
                 alibi="BH", softcap=3.0),
        # split-KV with the probability spread over the splits (ALiBi would gather it in the last)
        c.paged(seqused_k=(300, 0, 41), block_size=16, heads_q=9, heads_kv=3, softcap=2.0),
        c.paged(seqused_k=(70, 33), seqlen_q=3, block_size=48, heads_q=6, heads_kv=3, alibi="H"),
    ]


def covering_case(c: Checker, case) -> CaseResult:
    """The Checker call that stands for a point of the covering array (flashgen.coverage.Case)
    on c's spec: dense (B = 2) with its extras, varlen with an empty sequence and padding
    rows, or paged (block size 16, a shuffled table); a "fixed" bias gets no dbias."""
    (sq, sk), (hq, hkv) = case.seqlens, case.heads
    common = dict(heads_q=hq, heads_kv=hkv, bottom_right=case.bottom_right, window=case.window_sizes,
                  softcap=case.softcap, alibi=case.alibi)
    if case.layout == "dense":
        return c.dense(batch=2, seqlen_q=sq, seqlen_k=sk, bias=case.bias_dims(2), bias_f32=case.bias_f32,
                       bias_grad=case.bias_differentiated, bias_masks=True,
                       mask=case.mask_dims(2), segment_ids=case.segment_ids,
                       backward=case.direction == "bwd", **common)
    if case.layout == "varlen":
        return c.varlen(seqlens_q=(sq, 0, -(-sq // 3)), seqlens_k=(sk, 5, -(-sk // 2)), pad_q=3, pad_k=2,
                        backward=case.direction == "bwd", **common)
    return c.paged(seqused_k=(sk, sk // 2 + 1), seqlen_q=sq, block_size=16, **common)


def covering_cases(specs: list[KernelSpec], seed: int) -> list[tuple[KernelSpec, object]]:
    """Per target, the pairwise covering array of seed `seed` over the specs' head dims, each case
    moved onto the spec that agrees with most of its values (flashgen.coverage.project); a target
    with a family of its own (coverage.NATIVE) also gets the array over that family's subspace.
    Every target gets coverage.kernel_cases: the full space's array and the plain path's."""
    out = []
    for target in dict.fromkeys(s.target for s in specs):
        by_key = {(s.head_dim, s.dtype, s.causal): s for s in specs if s.target == target}
        head_dims = sorted({k[0] for k in by_key})
        cases = coverage.kernel_cases(head_dims, seed)
        if target in coverage.NATIVE:
            cases += coverage.covering_array(coverage.space(head_dims, target), seed)
        out += [(by_key[(c.head_dim, c.dtype, c.causal)], c) for c in coverage.project(cases, list(by_key))]
    return out


def format_table(rows: list[Row]) -> str:
    head = ("family", "spec", "case", "output", "rel. error", "tolerance", "seconds", "kernels", "")
    body = [(r.family, r.spec, r.case, r.output, f"{r.error:.2e}", f"{r.tolerance:g}", f"{r.seconds:.1f}",
             r.kernels, "ok" if r.ok else "FAIL") for r in rows]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(line, widths)).rstrip() for line in [head, *body])


def format_counters(rows: list[Row]) -> str:
    """One line per kernel of each handler call: its emulated counters (counts, not speed)."""
    calls = {(r.spec, r.call): r for r in rows}
    return "\n".join(["emulated counts, not speed:"] +
                     [f"  {r.spec} {r.family} {r.case} {kernel}: {counters.format_line(c)}"
                      for r in calls.values() for kernel, c in r.counters.items()])


def summarize(rows: list[Row]) -> str:
    """The largest error per family and element type, and the emulator's pace."""
    worst: dict = {}
    for r in rows:
        key = (r.family, r.spec.split("_")[1])  # stems read d64_bf16[_causal]
        worst[key] = max(worst.get(key, 0.0), r.error)
    dtypes = [t for t in NP_DTYPES if any(k[1] == t for k in worst)]
    families = list(dict.fromkeys(k[0] for k in worst))
    lines = ["largest relative error: " + "  ".join(f"{t:>9}" for t in dtypes)]
    lines += [f"  {f:<20}  " + "  ".join(f"{worst[(f, t)]:9.2e}" if (f, t) in worst else f"{'-':>9}"
                                        for t in dtypes) for f in families]
    calls = {(r.spec, r.call): (r.seconds, r.warp_instructions) for r in rows}
    seconds, instructions = (sum(c[i] for c in calls.values()) for i in (0, 1))
    lines.append(f"emulated {len(calls)} handler calls: {instructions:,} warp-instructions in {seconds:.0f} s "
                 f"({instructions / max(seconds, 1e-9) / 1e3:.0f} k warp-instructions/s)")
    return "\n".join(lines)


def cmd_check(args) -> int:
    from flashgen.bench_common import environment, json_output  # noqa: PLC0415
    from flashgen.build import build  # noqa: PLC0415 -- keeps `flashgen --help` light
    from flashgen.emulate.host import EmulatedLibrary  # noqa: PLC0415
    from flashgen.errors import UsageError  # noqa: PLC0415

    if not args.emulate:
        raise UsageError("flashgen check runs the CUDA kernels on the CPU under the PTX emulator: pass --emulate "
                         "(on a GPU machine, the GPU tests are `pytest -m gpu`)")
    if set(args.target) - set(targets.emulated()):
        *others, last = targets.emulated()
        names = f"{', '.join(others)} and {last}" if others else last
        raise UsageError(f"flashgen check emulates CUDA targets {names}, "
                         f"not {', '.join(args.target)}")
    causal = {"on": [True], "off": [False], "both": [False, True]}[args.causal]
    specs = [KernelSpec(d, t, c, target) for target in args.target for d in args.hdim for t in args.dtype
             for c in causal]
    if any(s.dtype not in NP_DTYPES for s in specs):
        raise UsageError(f"flashgen check has no cases for dtype(s) {', '.join(sorted(set(args.dtype) - set(NP_DTYPES)))} "
                         f"(the FP8 forward is checked by tests/test_fp8.py)")
    out = json_output(args.json) if args.json else None  # a bad location is refused before any work
    if args.counters:
        os.environ[counters.ENV] = "1"
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    seed = np.random.SeedSequence().entropy if args.seed is None else args.seed
    covering = covering_cases(specs, seed) if args.cases == "covering" else []
    rows: list[Row] = []
    t0 = time.perf_counter()
    for spec in specs:
        lib = EmulatedLibrary(build(spec, host="emulate", progress=say))
        say(f"{spec}: running its kernels under emulation (input seed {seed}); correctness only, not speed")
        c = Checker(lib, spec, np.random.default_rng(seed))
        results = [covering_case(c, case) for s, case in covering if s == spec] if covering else standard_cases(c)
        rows += [row for case in results for row in case.rows]
    print(format_table(rows))
    if args.counters:
        print(format_counters(rows))
    failed = sum(not r.ok for r in rows)
    if len(specs) > 1 or args.json:
        print(summarize(rows))
    print(f"{len(rows) - failed}/{len(rows)} outputs within tolerance in {time.perf_counter() - t0:.0f}s")
    if out:
        doc = {"environment": environment("cpu"), "emulated_targets": args.target, "seed": seed, "cases": args.cases,
               "specs": [str(s) for s in specs], "failed": failed, "rows": [dataclasses.asdict(r) for r in rows]}
        out.write(json.dumps(doc, indent=1).encode())
    return 1 if failed else 0


def register(sub) -> None:
    from flashgen.cli_args import add_spec_args, csv  # noqa: PLC0415

    p = sub.add_parser("check", help="run CUDA specs' kernels under the PTX emulator against float64 "
                                     "(no GPU needed)")
    p.add_argument("--target", required=True, type=csv, help=f"{', '.join(targets.emulated())} (comma-separated)")
    p.add_argument("--emulate", action="store_true", help="run on the CPU under flashgen's PTX emulator")
    add_spec_args(p, multi=True)
    p.add_argument("--causal", nargs="?", const="on", default="off", choices=["on", "off", "both"],
                   help="--causal alone: the causal spec; 'both': each spec both ways")
    p.add_argument("--cases", choices=["standard", "covering"], default="standard",
                   help="standard: a few cases that combine the features per entry point; covering: the "
                        "pairwise covering array of the feature space (flashgen.coverage, drawn from --seed) "
                        "projected onto the specs")
    p.add_argument("--seed", type=int, help="input seed, and the covering array's (default: fresh)")
    p.add_argument("--json", metavar="FILE", help="also write the rows, the seed and the environment as JSON")
    p.add_argument("--counters", action="store_true",
                   help="also print each kernel's emulated counters: tensor-core share of the warp-instructions, "
                        "shared-memory wavefronts against the conflict-free count, global bytes loaded per "
                        "tensor-core FLOP (counts for ranking tiles and catching regressions, never speed; "
                        "then also in --json's rows; sets FLASHGEN_EMULATE_COUNTERS=1)")
    p.set_defaults(func=cmd_check)
