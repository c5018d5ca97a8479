"""Fuzzing the rewriter's input handling, the CLI and the CPU FFI handlers (issue 15).

Every input must end in a result or a clean flashgen error (LoadError, UsageError,
FlashgenError); any other exception is a bug, and so is a crash. A crash cannot be caught in
the process it kills, so the fuzz runs in a child pytest (FLASHGEN_FUZZ_CHILD=1) that writes
each input to a file before trying it: if the child dies, the parent test fails naming the
signal and the saved input.

    FLASHGEN_FUZZ_EXAMPLES=2000 python3 -m pytest -q -s tests/test_fuzz.py   # a long campaign

In CI each target tries a few dozen inputs, the same ones every run (under a minute in all);
a campaign draws fresh ones and keeps a failing or crashing input in $TMPDIR.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

CHILD = os.environ.get("FLASHGEN_FUZZ_CHILD") == "1"
EXAMPLES = int(os.environ.get("FLASHGEN_FUZZ_EXAMPLES", "40"))
# The default run is a regression check (CI): the same inputs every time, so it fails on a
# change, never on the luck of a draw. A campaign (FLASHGEN_FUZZ_EXAMPLES set) explores.
EXPLORE = "FLASHGEN_FUZZ_EXAMPLES" in os.environ
GOLDEN = pathlib.Path(__file__).parent / "golden" / "inputs"
TARGETS = ("random_bytes", "mutated_text", "mutated_binary", "mutated_numerics", "cli_emit",
           "cli_run", "handler_attributes")


# ------------------------------------------------------------------------------ parent side
@pytest.mark.skipif(CHILD, reason="the parent test")
@pytest.mark.parametrize("target", TARGETS)
def test_fuzz(tmp_path, target):
    current = tmp_path / "current.bin"
    stats = tmp_path / "stats.json"
    env = dict(os.environ, FLASHGEN_FUZZ_CHILD="1", FLASHGEN_FUZZ_CURRENT=str(current),
               FLASHGEN_FUZZ_STATS=str(stats))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__,
         "-k", f"child_{target}"], env=env, capture_output=True, text=True, timeout=3000)
    if proc.returncode != 0:  # the last input tried is the culprit: keep it past tmp_path
        saved = current.read_bytes() if current.exists() else b""
        crashed = proc.returncode < 0 or proc.returncode in (139, 134, 135)
        keep = pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / \
            f"flashgen-fuzz-{'crash' if crashed else 'failure'}-{target}.bin"
        keep.write_bytes(saved)
        pytest.fail(f"the {target} fuzz child {'crashed' if crashed else 'failed'} (exit {proc.returncode}); "
                    f"input saved to {keep} ({len(saved)} bytes)\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}")
    counts = json.loads(stats.read_text())
    tried = counts["tried"]
    print(f"{target}: {tried} inputs, no crash; {counts['outcomes']}")
    assert tried >= min(EXAMPLES, 4)


def test_finding_nan_in_constant_bias_is_not_a_mask():
    """mutated_numerics turned one -inf of a causal bias into NaN: the rewriter took the NaN
    for a masked key and the rewritten row came out finite where the original is NaN."""
    import flashgen.rewrite as fr
    text = (GOLDEN / "einsum_additive_bias.mlir").read_text()
    assert fr.rewrite(text).rewritten
    at = text.index("dense<[[")  # the bias table; the first -inf in it becomes a NaN
    nan = text[:at] + text[at:].replace("0xFF800000", "0xFF810000", 1)
    result = fr.rewrite(nan)
    assert not result.rewritten and "NaN" in result.rejected[0].reason


def test_finding_negative_dimension_is_a_load_error():
    """mutated_binary gave a shape-polymorphic module's dynamic_broadcast_in_dim a result
    dimension of -(2**63 - 1): bytecode carries it, its text does not parse back, and the
    refinement's re-parse raised a bare MLIRError. It is refused when the module is read."""
    import flashgen.rewrite as fr
    from flashgen.errors import LoadError
    data = (pathlib.Path(__file__).parent / "fuzz_findings" / "negative_dimension.jax_exported").read_bytes()
    with pytest.raises(LoadError, match="negative dimension"):
        fr.rewrite(data)


def test_finding_nan_softmax_max_init_refused():
    """mutated_numerics turned the softmax max's -inf initial value into NaN: every row of
    the original is NaN, the rewritten one was finite."""
    import flashgen.rewrite as fr
    text = (GOLDEN / "jnn_f32.mlir").read_text()
    assert "dense<0xFF800000> : tensor<f32>" in text and fr.rewrite(text).rewritten
    result = fr.rewrite(text.replace("dense<0xFF800000> : tensor<f32>",
                                     "dense<0xFF810000> : tensor<f32>"))
    assert not result.rewritten and "nan" in result.rejected[0].reason.lower()


def test_finding_finite_softmax_max_init_refused():
    """mutated_numerics made the max's init -1.7e38 instead of -inf in a padding-masked model:
    the original's fully masked rows stay NaN, the rewrite gave them finite values."""
    import flashgen.rewrite as fr
    text = (GOLDEN / "flax_nnx_padding_mask.mlir").read_text()
    assert fr.rewrite(text).rewritten
    result = fr.rewrite(text.replace("dense<0xFF800000> : tensor<f32>",
                                     "dense<0xFF000000> : tensor<f32>", 1))
    assert not result.rewritten and "not -inf" in result.rejected[0].reason


# ------------------------------------------------------------------------------ child side
if CHILD:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from flashgen.errors import FlashgenError

    FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=not EXPLORE,
                    suppress_health_check=list(HealthCheck))
    _stats = {"tried": 0, "outcomes": {}}

    def _attempt(data: bytes) -> None:
        """Record the input (for a post-mortem), then count it."""
        pathlib.Path(os.environ["FLASHGEN_FUZZ_CURRENT"]).write_bytes(data)
        _stats["tried"] += 1
        _save()

    def _outcome(what: str) -> None:
        _stats["outcomes"][what] = _stats["outcomes"].get(what, 0) + 1
        _save()

    def _save() -> None:
        pathlib.Path(os.environ["FLASHGEN_FUZZ_STATS"]).write_text(json.dumps(_stats))

    def _error_kind(e: Exception) -> str:
        text = str(e)
        if "crashed" in text:
            return "refused: reader crashed in the probe process"
        if "nested" in text:
            return "refused: nested too deep"
        return type(e).__name__

    def _rewrite_recorded(data: bytes):
        """The rewrite of ``data``, or None when it is refused (the refusal counted)."""
        import flashgen.rewrite as fr
        _attempt(data)
        try:
            return fr.rewrite(data)
        except FlashgenError as e:
            _outcome(_error_kind(e))
            return None

    def _rewrite_cleanly(data: bytes) -> None:
        result = _rewrite_recorded(data)
        if result is None:
            return
        result.to_bytes()  # what was read must also write back
        result.report().dumps()
        _outcome(f"read ({len(result.rewritten)} site(s) rewritten)" if result.rewritten
                 else "read, nothing rewritten")

    def _corpus(binary: bool) -> list[bytes]:
        files = sorted(GOLDEN.iterdir())
        picked = [p.read_bytes() for p in files if (p.suffix != ".mlir") == binary]
        return picked + [b"ML\xefR" + bytes(64)] if binary else picked  # bare bytecode magic

    def _mutate(data: bytes, ops) -> bytes:
        b = bytearray(data)
        for kind, pos, arg in ops:
            if not b:
                break
            i = pos % len(b)
            if kind == "flip":
                b[i] ^= 1 << (arg % 8)
            elif kind == "byte":
                b[i] = arg % 256
            elif kind == "delete":
                del b[i:i + 1 + arg % 64]
            elif kind == "duplicate":
                b[i:i] = b[i:i + 1 + arg % 256]
            elif kind == "truncate":
                del b[i:]
            elif kind == "digit":  # numbers drive shapes and dims: the likeliest to hurt
                digits = [j for j in range(len(b)) if 48 <= b[j] <= 57]
                if digits:
                    b[digits[pos % len(digits)]] = 48 + arg % 10
            elif kind == "constant":  # a digit of a dense<...> value: the module stays valid,
                spans = [m.span() for m in re.finditer(rb"dense<[^>]*>", bytes(b))]  # masks,
                digits = [j for lo, hi in spans for j in range(lo, hi)  # scales, fills change
                          if 48 <= b[j] <= 57]
                if digits:
                    b[digits[pos % len(digits)]] = 48 + arg % 10
        return bytes(b)

    MUTATIONS = st.lists(st.tuples(
        st.sampled_from(["flip", "byte", "delete", "duplicate", "truncate", "digit", "digit",
                         "constant", "constant", "constant"]),
        st.integers(0, 1 << 30), st.integers(0, 1 << 16)), min_size=1, max_size=6)

    @FUZZ
    @given(st.binary(max_size=4096) | st.text(max_size=2048).map(str.encode))
    def test_child_random_bytes(data):
        _rewrite_cleanly(data)

    @FUZZ
    @given(st.integers(0, 1 << 20), MUTATIONS)
    def test_child_mutated_text(which, ops):
        corpus = _corpus(binary=False)
        _rewrite_cleanly(_mutate(corpus[which % len(corpus)], ops))

    @settings(FUZZ, max_examples=max(4, EXAMPLES // 4))  # each binary input costs a probe process
    @given(st.integers(0, 1 << 20), MUTATIONS)
    def test_child_mutated_binary(which, ops):
        corpus = _corpus(binary=True)
        _rewrite_cleanly(_mutate(corpus[which % len(corpus)], ops))

    CONSTANTS = st.lists(st.tuples(st.just("constant"), st.integers(0, 1 << 30),
                                   st.integers(0, 9)), min_size=1, max_size=3)

    @settings(FUZZ, max_examples=max(4, EXAMPLES // 5))  # each rewritten input runs twice
    @given(st.integers(0, 1 << 20), CONSTANTS, st.integers(0, 1 << 30))
    def test_child_mutated_numerics(which, ops, seed):
        """Constants (masks, fills, scales, biases) changed: whatever the rewriter then still
        rewrites must compute what the changed module computes -- a wrong answer is a bug too."""
        from flashgen import execute
        from flashgen.rewrite import modules, verify
        # no loops: a changed trip count or step (dense<1> -> dense<0>) runs forever
        corpus = [t for t in _corpus(binary=False) if b"stablehlo.while" not in t]
        data = _mutate(corpus[which % len(corpus)], ops)
        result = _rewrite_recorded(data)
        if result is None:
            return
        if not result.rewritten:
            _outcome("read, nothing rewritten")
            return
        original = modules.load(data)
        inputs = verify.inputs_for(original, seed)
        try:
            ref = execute.run(original, inputs, register=False)
        except FlashgenError:
            _outcome("the changed original does not run")
            return
        got = execute.run(modules.load(result.to_bytes()), inputs)
        rows = verify.compare(ref, got, result.rewritten)
        assert all(r["ok"] for r in rows), (rows, data.decode(errors="replace"))
        _outcome("rewritten, outputs equal")

    SIZES = st.one_of(st.integers(1, 64), st.integers(-3, 300),
                      st.sampled_from([0, 1, 2**31, -(2**40), 10**30]))

    @FUZZ
    @given(st.fixed_dictionaries({
        "--hdim": st.sampled_from([32, 64, 128, 256]) | SIZES, "--seq-q": SIZES, "--heads": SIZES,
    }, optional={
        "--seq-k": SIZES, "--kv-heads": SIZES, "--batch": SIZES, "--dtype": st.sampled_from(
            ["bf16", "f16", "f32", "f64", "int8", ""]), "--window-left": SIZES,
        "--window-right": SIZES, "--softcap": st.floats(allow_nan=True),
        "--scale": st.floats(allow_nan=True), "--extras": st.sampled_from(
            ["", "alibi", "bias,mask", "segment_ids", "mask,mask", "bogus", ","]),
    }), st.booleans(), st.booleans())
    def test_child_cli_emit(flags, causal, module):
        from flashgen import cli
        argv = ["emit"] + [x for k, v in flags.items() for x in (k, str(v))]
        argv += ["--causal"] * causal + ["--module"] * module
        _attempt(" ".join(argv).encode())
        rc = cli.main(argv)
        assert rc in (0, 1, 2)
        _outcome(f"exit {rc}")

    DTYPES = st.sampled_from(["float32", "float32", "bfloat16", "float16", "float64", "int32", "uint16",
                              "int64", "bool", "complex64"])

    @settings(FUZZ, max_examples=max(4, EXAMPLES // 4))  # each input may compile and run a module
    @given(st.sampled_from(["jnn_f32.mlir", "einsum_additive_bias.mlir", "jnn_causal_bf16.mlir"]),
           st.data())
    def test_child_cli_run(module, data):
        """`flashgen run MODULE --inputs F` with arrays of any dtype and shape under right or wrong
        names, or a file that is no .npz at all: it runs, or answers exit 1/2 with one line."""
        import io
        import tempfile
        import ml_dtypes
        from flashgen import cli, execute
        params = execute.signature(GOLDEN / module)[0]
        buf = io.BytesIO()
        if data.draw(st.integers(0, 9)) == 0:
            buf.write(data.draw(st.binary(max_size=512)))
        else:
            arrays = {}
            for i, p in enumerate(params):
                if data.draw(st.integers(0, 9)) == 0:
                    continue  # a missing input
                # mostly right, so that the module also runs on what a user would feed it
                shape = list(p.shape) if data.draw(st.integers(0, 4)) else \
                    data.draw(st.lists(st.integers(0, 9), max_size=5))
                dtype = p.dtype if data.draw(st.integers(0, 3)) else data.draw(DTYPES)
                name = f"arg{i}" if data.draw(st.integers(0, 9)) else data.draw(st.text(max_size=5))
                arrays[name] = np.full(shape, 0.5).astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
            np.savez(buf, **arrays)
        _attempt(buf.getvalue())
        with tempfile.NamedTemporaryFile(suffix=".npz") as f:
            f.write(buf.getvalue())
            f.flush()
            rc = cli.main(["run", str(GOLDEN / module), "--inputs", f.name])
        assert rc in (0, 1, 2)
        _outcome(f"exit {rc}")

    _SPEC_DIMS = (32, "f32")

    @FUZZ
    @given(
        causal=st.booleans(), bottom_right=st.booleans(),
        scale=st.floats(0.0009765625, 10, width=32) | st.floats(allow_nan=True, width=32),
        softcap=st.just(0.0) | st.floats(0.125, 50, width=32) | st.floats(allow_nan=True, width=32),
        window=st.tuples(st.integers(-5, 40), st.integers(-5, 40)) | st.tuples(
            st.sampled_from([-(2**31), 2**31 - 1]), st.sampled_from([-1, 0, 2**31 - 1])),
        extras=st.sampled_from(["", "", "", "alibi", "bias", "mask", "segment_ids", "bogus"]),
        sq=st.integers(1, 40), sk=st.integers(1, 40), h=st.sampled_from([1, 2, 4]),
        kvh=st.sampled_from([1, 1, 2, 2, 3]), d=st.sampled_from([32, 32, 32, 32, 16, 64]),
        api=st.sampled_from([4, 4, 4, 4, 1]), lse_rank=st.sampled_from([3, 3, 3, 3, 2]))
    def test_child_handler_attributes(causal, bottom_right, scale, softcap, window, extras, sq,
                                      sk, h, kvh, d, api, lse_rank):
        """Hand-written custom calls with any attributes and (possibly wrong) shapes reach the
        real CPU handler: it must answer with an error or compute, never crash."""
        from flashgen import execute
        from flashgen.spec import KernelSpec
        spec = KernelSpec(_SPEC_DIMS[0], _SPEC_DIMS[1], causal, "cpu")
        q_t = f"tensor<1x{sq}x{h}x{d}xf32>"
        kv_t = f"tensor<1x{sk}x{kvh}x{d}xf32>"
        lse_t = f"tensor<1x{h}x{sq}xf32>" if lse_rank == 3 else f"tensor<{h}x{sq}xf32>"
        bits = lambda x: f"0x{int(np.float32(x).view(np.uint32)):08X}"  # noqa: E731 - NaN, inf too
        attrs = (f"bottom_right = {str(bottom_right).lower()}, causal = {str(causal).lower()}, "
                 f"extras = \"{extras}\", scale = {bits(scale)} : f32, softcap = "
                 f"{bits(softcap)} : f32, window_left = {window[0]} : i32, "
                 f"window_right = {window[1]} : i32")
        text = (f"module {{ func.func public @main(%q: {q_t}, %k: {kv_t}, %v: {kv_t}) -> "
                f"({q_t}, {lse_t}) {{\n  %0:2 = stablehlo.custom_call "
                f"@{spec.target_name('fwd')}(%q, %k, %v) {{api_version = {api} : i32, "
                f"backend_config = {{{attrs}}}}} : ({q_t}, {kv_t}, {kv_t}) -> ({q_t}, {lse_t})\n"
                f"  return %0#0, %0#1 : {q_t}, {lse_t}\n}} }}\n")
        _attempt(text.encode())
        rng = np.random.default_rng()
        x = [rng.standard_normal(s).astype(np.float32)
             for s in ((1, sq, h, d), (1, sk, kvh, d), (1, sk, kvh, d))]
        try:
            execute.run(text, x)
        except FlashgenError as e:
            _outcome("error: " + str(e).split(":")[0][:60])
        else:
            _outcome("computed")
