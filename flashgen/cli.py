"""The `flashgen` command line: build, emit, demo, rewrite, run, bench, check.

Errors print as one line on stderr: exit 2 for usage, 1 for failures;
--debug shows the traceback.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from flashgen.cli_args import add_spec_args, positive_int
from flashgen.errors import FlashgenError, UsageError
from flashgen.spec import KernelSpec
from flashgen.targets import TARGETS


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's default prints usage; we want one line, exit 2
        raise UsageError(f"{self.prog}: {message}")


def _causal_values(args) -> list[bool]:
    return [False, True] if args.both else [bool(args.causal)]


def cmd_build(args) -> int:
    from flashgen.build import build, resolve_target
    if args.out:  # checked before minutes of compiling
        from flashgen.output_files import check_directory
        check_directory("--out", args.out)
    target, why = resolve_target(args.target)
    specs = [KernelSpec(d, t, c, target, args.hdim_v) for d in args.hdim for t in args.dtype
             for c in _causal_values(args)]
    print(f"target: {target} ({why})", file=sys.stderr)
    if args.verbose:
        logging.getLogger("flashgen").setLevel(logging.DEBUG)
    lib = build(specs, out=args.out, jobs=args.jobs, host=args.host)
    print(lib.path)
    print(f"manifest: {lib.manifest_path}", file=sys.stderr)
    for s in specs:
        print("  " + ", ".join(s.target_name(d) for d in s.directions), file=sys.stderr)
    return 0


def cmd_emit(args) -> int:
    from flashgen.emit import attention_module
    spec = KernelSpec(args.hdim, args.dtype, bool(args.causal), head_dim_v=args.hdim_v)
    seq_k = args.seq_q if args.seq_k is None else args.seq_k
    module = attention_module(spec, batch=args.batch, seq_q=args.seq_q, seq_k=seq_k,
                              heads=args.heads, kv_heads=args.kv_heads, scale=args.scale,
                              bottom_right=args.bottom_right, window=(args.window_left, args.window_right),
                              softcap=args.softcap, extras=args.extras, legacy_attrs=args.legacy_attrs)
    if args.module:
        print(module)
    else:
        (op,) = [op for op in module.body.operations[0].regions[0].blocks[0].operations
                 if op.name == "stablehlo.custom_call"]
        print(op)
    return 0


def cmd_demo(args) -> int:
    from flashgen import demo
    return demo.run(head_dim=args.hdim, dtype=args.dtype, causal=bool(args.causal), target=args.target)


def make_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="flashgen", description="FlashAttention kernels generated per spec, "
                                             "called from StableHLO.")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.add_argument("--version", action="version", version=_version())
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    b = sub.add_parser("build", help="render and compile kernels into a cached shared library")
    add_spec_args(b, multi=True)
    g = b.add_mutually_exclusive_group()
    g.add_argument("--causal", action="store_true", help="causal kernels")
    g.add_argument("--no-causal", dest="causal", action="store_false", help="non-causal kernels (default)")
    g.add_argument("--both", action="store_true", help="causal and non-causal kernels")
    b.add_argument("--target", default="auto", choices=["auto", *TARGETS],
                   help="auto: the local GPU's arch, else cpu")
    b.add_argument("--out", help="also copy the library and manifest.json into this directory")
    b.add_argument("-j", "--jobs", type=positive_int, help="parallel compiles (default: CPU count)")
    b.add_argument("--for", dest="host", choices=["python", "exla", "c", "nif"], default="python",
                   help="python: pybind11 face for JAX (default); exla: static handler registration "
                        "on load (EXLA.NIF.load_dylib), no Python; c: plain C symbols only; "
                        "nif: an erl_nif library for Elixir/Erlang (FlashGen.NIF, examples/elixir; cpu only)")
    b.add_argument("-v", "--verbose", action="store_true", help="also report cache hits")
    b.set_defaults(func=cmd_build)

    e = sub.add_parser("emit", help="print the stablehlo.custom_call (or a whole module) for a spec")
    add_spec_args(e, multi=False)
    e.add_argument("--causal", action="store_true")
    e.add_argument("--bottom-right", action="store_true",
                   help="causal mask aligned to the bottom-right (FlashAttention-2) instead of top-left")
    e.add_argument("--window-left", type=int, default=-1,
                   help="sliding window: keys visible to the left of the diagonal (-1 = unbounded)")
    e.add_argument("--window-right", type=int, default=-1,
                   help="sliding window: keys visible to the right of the diagonal (-1 = unbounded)")
    e.add_argument("--softcap", type=float, default=0.0, help="logit softcap c·tanh(x/c) (0 = off)")
    e.add_argument("--extras", default="",
                   help="extra operands, comma-separated: alibi,bias,mask,segment_ids (README 'Variants')")
    e.add_argument("--batch", type=int, default=1)
    e.add_argument("--seq-q", type=int, required=True)
    e.add_argument("--seq-k", type=int, help="default: --seq-q")
    e.add_argument("--heads", type=int, required=True)
    e.add_argument("--kv-heads", type=int, help="default: --heads")
    e.add_argument("--scale", type=float, help="default: 1/sqrt(head_dim)")
    e.add_argument("--module", action="store_true", help="print a complete module with @main")
    e.add_argument("--legacy-attrs", action="store_true",
                   help="mhlo.backend_config form (what jax.ffi.ffi_call prints)")
    e.set_defaults(func=cmd_emit)

    d = sub.add_parser("demo", help="build one spec for the local target and check it against a reference")
    d.add_argument("--hdim", type=int, default=64)
    d.add_argument("--dtype", default="bf16")
    d.add_argument("--causal", action="store_true")
    d.add_argument("--target", default="auto", choices=["auto", *TARGETS])
    d.set_defaults(func=cmd_demo)

    for module in _plugin_modules():
        module.register(sub)
    for command in sub.choices.values():  # `flashgen rewrite ... --debug` as well as before it
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help="show tracebacks")
    return p


def _plugin_modules():
    """Subcommands that live beside their subsystem (rewrite/run, bench, check)."""
    import importlib
    for name in ("flashgen.cli_rewrite", "flashgen.cli_cache", "flashgen.bench", "flashgen.emulate.check"):
        try:
            yield importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise


def _version() -> str:
    from importlib import metadata
    from flashgen import __version__
    try:
        jax = f"jax {metadata.version('jax')}, jaxlib {metadata.version('jaxlib')}"
    except metadata.PackageNotFoundError:
        jax = "jax not installed"
    return f"flashgen {__version__} ({jax}, Python {sys.version.split()[0]})"


def _quiet_runtime_logs() -> None:
    """XLA prints INFO lines (device counts) on every start; a user who wants them sets
    TF_CPP_MIN_LOG_LEVEL=0. Progress of flashgen's own builds goes to stderr."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("flashgen: %(message)s"))
    logger = logging.getLogger("flashgen")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    _quiet_runtime_logs()
    debug = "--debug" in argv
    try:
        args = make_parser().parse_args(argv)
        if not getattr(args, "func", None):
            make_parser().print_help()
            return 2
        return args.func(args)
    except (UsageError, ValueError) as e:  # invalid input: unsupported spec, bad flag, bad file
        if debug:
            raise
        print(f"flashgen: error: {e}", file=sys.stderr)
        return 2
    except (FlashgenError, OSError) as e:
        if debug:
            raise
        msg = str(e).strip()
        first, _, rest = msg.partition("\n")
        print(f"flashgen: error: {first}", file=sys.stderr)
        if rest:  # a compiler's own message: keep it, indented, after the one-line summary
            print("\n".join("  " + l for l in rest.splitlines()), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("flashgen: interrupted", file=sys.stderr)
        _exit_if_still_running(130)
        return 130


def _exit_if_still_running(code: int) -> None:
    """A computation that did not stop (XLA's own ops take no cancel) would hold up the
    interpreter's exit: leave at once. Outputs are written only after a run, atomically."""
    import threading
    from flashgen.execute import RUN_THREAD
    if any(t.name == RUN_THREAD and t.is_alive() for t in threading.enumerate()):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
