"""The `flashgen rewrite` and `flashgen run` subcommands."""
from __future__ import annotations

import pathlib
import sys

from flashgen import output_files
from flashgen.errors import FlashgenError, UsageError

OUTPUT_FORMATS = ("mlir", "mlirbc", "portable", "jax_exported")


def register(subparsers) -> None:
    r = subparsers.add_parser(
        "rewrite", help="replace attention in a StableHLO module with flashgen custom calls",
        description="Find dot_general -> softmax -> dot_general attention in a StableHLO module "
                    "(text, MLIR bytecode, portable artifact or serialized jax.export) and "
                    "replace every site that fully matches with one flashgen custom call. "
                    "Sites that do not match are left untouched; --explain says why.")
    r.add_argument("input", metavar="IN", help="the module: .mlir text, .mlirbc bytecode or "
                   "portable artifact, or a serialized jax.export.Exported (format read from "
                   "the content)")
    r.add_argument("-o", "--output", metavar="OUT",
                   help="write the rewritten module here (default: write nothing); an input "
                        "with nothing to rewrite is copied unchanged")
    r.add_argument("--output-format", choices=OUTPUT_FORMATS,
                   help="format of OUT (default: the input's); jax_exported needs a "
                        "jax_exported input")
    r.add_argument("--report", metavar="REPORT.json",
                   help="write a JSON report: every site with location, shapes, layout, dtype, "
                        "heads, mask, scale, target and status/reason")
    r.add_argument("--explain", action="store_true",
                   help="print every site and near miss readably, with the reason a candidate "
                        "was left alone")
    r.add_argument("--verify", action="store_true",
                   help="run the original and the rewritten module on the same random inputs on "
                        "CPU (building the kernels needed); fail without writing anything if an "
                        "output differs beyond the dtype's tolerance")
    r.add_argument("--seed", type=int, default=0, help="random seed for --verify inputs (default 0)")
    r.add_argument("--verify-inputs", metavar="IN.npz",
                   help="--verify on these arrays (your inputs and parameters, arg0..argN in "
                        "@main's order, as flashgen run --inputs reads) instead of random ones")
    r.add_argument("--build", metavar="DIR", nargs="?", const="",
                   help="build the CPU kernels the rewritten module needs and copy the library "
                        "and manifest.json into DIR (default: OUT's directory); the report names "
                        "the manifest to pass to flashgen.jax.load")
    r.add_argument("--legacy-attrs", action="store_true",
                   help="emit the mhlo.backend_config attribute form (what jax.ffi.ffi_call "
                        "prints) instead of the native api_version=4 form")
    r.add_argument("--no-sharding-rule", action="store_true",
                   help="leave the sdy.sharding_rule off the flashgen calls (for readers without "
                        "the sdy dialect, e.g. torch_xla's _run_stablehlo); sharded JAX programs "
                        "then replicate the calls")
    r.add_argument("-q", "--quiet", action="store_true", help="no summary line on stderr")
    r.set_defaults(func=cmd_rewrite)

    u = subparsers.add_parser(
        "run", help="execute a StableHLO module on CPU or CUDA with inputs from an .npz",
        description="Run @main of a module (any format flashgen reads) with numpy inputs. "
                    "flashgen custom calls in the module are built and registered first.")
    u.add_argument("module", metavar="MODULE", help="the module file (.mlir, .mlirbc, "
                   ".jax_exported)")
    u.add_argument("--inputs", metavar="IN.npz",
                   help="arrays arg0..argN in @main's parameter order; 2-byte arrays stored as "
                        "uint16 or |V2 are reinterpreted as the parameter's type (bf16). "
                        "Without it, random inputs are used (see --seed)")
    u.add_argument("--outputs", metavar="OUT.npz",
                   help="write results as out0..outM (bf16 stored as uint16 bit patterns)")
    u.add_argument("--platform", choices=("cpu", "cuda"), default="cpu",
                   help="where to run (default cpu)")
    u.add_argument("--seed", type=int, default=0, help="seed for random inputs without --inputs")
    u.add_argument("--library", metavar="DIR",
                   help="take the flashgen kernels from this built library (a directory with "
                        "manifest.json, e.g. from flashgen build --out or rewrite --build) "
                        "instead of building them: no compiler needed")
    u.set_defaults(func=cmd_run)


# ------------------------------------------------------------------------------ rewrite
def cmd_rewrite(args) -> int:
    from flashgen import rewrite as rw

    # every output location is checked before the (possibly long) rewrite, verify and build
    outputs = [("-o", args.output), ("--report", args.report)]
    inputs = [p for p in (args.input, args.verify_inputs) if p]
    out, report_file = output_files.check(outputs, inputs=inputs)
    build_dir = None
    if args.build is not None:
        build_dir = args.build or (str(pathlib.Path(out.target).parent) if out else None)
        if not build_dir:
            raise UsageError("--build needs a directory when there is no -o OUT")
        output_files.check_directory("--build", build_dir)
        _check_build_files(build_dir, outputs, inputs)
    result = rw.rewrite(args.input, legacy_attrs=args.legacy_attrs)
    report = result.report(input=args.input, output=args.output)
    fmt = args.output_format or result.format
    if fmt == "jax_exported" and result.format != "jax_exported":
        raise UsageError("--output-format jax_exported needs a jax_exported input (a plain "
                         "module has no calling convention to export)")

    verifying = args.verify or bool(args.verify_inputs)
    if verifying and result.changed:
        from flashgen.rewrite import verify
        report.verified = verify.verify(result, args.seed, args.verify_inputs)
        bad = [row for row in report.verified["outputs"] if not row["ok"]]
        if bad:
            _write_report(report_file, report)
            if args.explain:
                print(report.explain())
            raise FlashgenError("--verify failed: " + "; ".join(verify.describe(row) for row in bad)
                                + "; nothing written")
    elif verifying:
        report.verified = {"outputs": [], "note": "nothing was rewritten"}

    if args.no_sharding_rule:
        _remove_sharding_rules(result)
    data = _encode(result, fmt)
    if build_dir is not None and result.specs:
        from flashgen.build import build
        lib = build(result.specs, "cpu", out=build_dir)
        # absolute: the report is read from anywhere, not from this working directory
        report.library, report.manifest = str(lib.path.resolve()), str(lib.manifest_path.resolve())
    if out:
        out.write(data)
    _write_report(report_file, report)
    if args.explain:
        print(report.explain())
    if not args.quiet:
        where = f" -> {args.output}" if args.output else " (no -o: nothing written)"
        print(f"flashgen rewrite: {len(result.rewritten)} site(s) rewritten, "
              f"{len(result.rejected)} left untouched in {result.seconds:.2f}s{where}",
              file=sys.stderr)
        if report.verified and report.verified["outputs"]:
            print(_verified_line(report.verified), file=sys.stderr)
        if report.manifest:
            print(f"manifest: {report.manifest}", file=sys.stderr)
    return 0


def _verified_line(verified: dict) -> str:
    rows = verified["outputs"]
    on = f"the inputs in {verified['inputs']}" if verified.get("inputs") else \
        f"random inputs (seed {verified['seed']})"
    judged = [row["f32_original"] for row in rows if isinstance(row.get("f32_original"), dict)]
    if judged:
        worst = max(judged, key=lambda j: j["rewrite_error"])
        error = (f"largest error against the original run in f32 {worst['rewrite_error']:.3g} "
                 f"(the bf16/f16 original's own {worst['original_error']:.3g})")
    else:
        worst = max(rows, key=lambda row: row["max_error"] / max(row["tolerance"], 1e-30))
        error = f"largest error {worst['max_error']:.3g} (tolerance {worst['tolerance']:.3g})"
    return f"verified: {len(rows)} output(s) match the original on {on}; {error}"


def _check_build_files(build_dir: str, outputs, inputs) -> None:
    """--build writes DIR/manifest.json and DIR/<library>.so: -o and --report may be neither."""
    from flashgen.build import LIBRARY_PREFIX
    from flashgen.cache import MANIFEST
    output_files.check([*outputs, ("--build", str(pathlib.Path(build_dir) / MANIFEST))], inputs,
                       make_dirs=True)  # DIR may not exist yet
    for flag, path in outputs:
        p = pathlib.Path(path or "")
        if path and p.name.startswith(LIBRARY_PREFIX) and p.suffix == ".so" \
                and output_files.same_file(p.parent, build_dir):
            raise UsageError(f"--build and {flag} name the same file {path}: --build writes "
                             "the library there")


def _remove_sharding_rules(result) -> None:
    from flashgen.rewrite.graph import flashgen_calls
    with result.loaded.context:
        for op, _ in flashgen_calls(result.module.operation):
            if "sdy.sharding_rule" in op.attributes:
                del op.attributes["sdy.sharding_rule"]


def _encode(result, fmt: str) -> bytes:
    from flashgen.rewrite import modules
    if fmt == result.format:
        return result.to_bytes()
    loaded = result.loaded
    with loaded.context:
        if fmt == "mlir":
            return modules.module_text(result.module, True).encode()
        if fmt == "mlirbc":
            import io
            out = io.BytesIO()
            result.module.operation.write_bytecode(out)
            return out.getvalue()
        return modules.serialize_artifact(result.module, loaded.version)


def _write_report(report_file, report) -> None:
    if report_file:
        report_file.write(report.dumps().encode())


# ------------------------------------------------------------------------------ run
def cmd_run(args) -> int:
    import numpy as np
    from flashgen import execute
    from flashgen.rewrite import modules
    (out,) = output_files.check([("--outputs", args.outputs)],
                                inputs=[p for p in (args.module, args.inputs) if p])
    loaded = modules.load(args.module)
    params, _ = execute.signature(loaded)
    if args.inputs:
        inputs = execute.load_npz(args.inputs, params)
    else:
        inputs = execute.random_inputs(params, args.seed)
    try:
        outputs = execute.run(loaded, inputs, platform=args.platform, library=args.library)
    except execute.OutOfMemory as e:
        hint = "" if execute.flashgen_targets(loaded) else \
            ": an attention left as it is holds every score in memory; flashgen rewrite it"
        raise FlashgenError(f"{args.module}: {e}{hint}") from None
    if out:
        out.write(execute.npz_bytes(outputs))
    for i, a in enumerate(outputs):
        a = np.asarray(a)
        flat = a.astype(np.float64).ravel() if a.dtype.kind in "fV" or a.dtype.itemsize == 2 \
            else a.ravel()
        head = ", ".join(f"{x:.6g}" if isinstance(x, float) else str(x) for x in flat[:4].tolist())
        print(f"out{i}: {list(a.shape)} {execute._element_name(a.dtype)} [{head}"
              f"{', ...' if flat.size > 4 else ''}]")
    return 0
