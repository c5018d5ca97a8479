"""Deep and long modules: a 1,000-layer unrolled model rewrites end to end, a 1,000-deep chain of
private calls is walked without recursion, and nesting that would overflow the MLIR parser's
stack is refused with a clear error before it reaches the parser (issue 15, item 4).

Whatever could take a process down runs in a child interpreter here, so a regression fails one
test instead of killing the run."""
from __future__ import annotations

import io
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import flashgen.rewrite as fr
from flashgen.errors import LoadError
from flashgen.rewrite import modules

LAYERS = 1000
B, T, H, D = 1, 8, 2, 32


def _gpt(layers: int) -> bytes:
    """A plain-JAX causal transformer stack of ``layers`` unrolled attention + tanh-MLP layers."""
    import jax
    import jax.numpy as jnp
    from jax import export

    def layer(x, w):
        q, k, v = ((x @ (w * c)).reshape(B, T, H, D) for c in (1.0, 0.5, 0.25))
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
        s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -jnp.inf)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v).reshape(B, T, H * D)
        x = x + o
        return x + jnp.tanh(x @ w) * 0.1

    def model(x, w):
        for _ in range(layers):
            x = layer(x, w)
        return x

    spec = jax.ShapeDtypeStruct((B, T, H * D), jnp.float32), jax.ShapeDtypeStruct((H * D, H * D), jnp.float32)
    return export.export(jax.jit(model))(*spec).mlir_module().encode()


def test_1000_layer_model_rewrites_every_site():
    assert sys.getrecursionlimit() <= 10_000  # no reliance on a raised limit
    result = fr.rewrite(_gpt(LAYERS))
    assert len(result.rewritten) == LAYERS and not result.rejected
    text = result.to_bytes().decode()
    assert text.count("stablehlo.custom_call @flashgen_fwd") == LAYERS
    assert "stablehlo.exponential" not in text
    assert all(s.causal for s in result.rewritten)


def test_layer_stack_numerics(rng):
    """The rewritten stack computes what the original does (CPU kernels, fresh inputs). 24
    layers: XLA takes minutes to compile the 1,000-layer module, and errors compound with depth."""
    from flashgen import execute
    data = _gpt(24)
    result = fr.rewrite(data)
    x = rng.standard_normal((B, T, H * D)).astype(np.float32)
    w = (rng.standard_normal((H * D, H * D)) / np.sqrt(H * D) * 0.3).astype(np.float32)
    ref = execute.run(modules.load(data), [x, w], register=False)
    got = execute.run(modules.load(result.to_bytes()), [x, w])
    rows = execute.compare(ref, got, "f32")
    assert all(r["ok"] for r in rows), rows


def _call_chain(depth: int) -> str:
    """@main's causal mask is computed by @m0, which calls @m1, ... down to @m{depth-1}."""
    funcs = []
    for i in range(depth - 1):
        funcs.append(f"""
  func.func private @m{i}() -> tensor<{T}x{T}xi1> {{
    %0 = func.call @m{i + 1}() : () -> tensor<{T}x{T}xi1>
    return %0 : tensor<{T}x{T}xi1>
  }}""")
    funcs.append(f"""
  func.func private @m{depth - 1}() -> tensor<{T}x{T}xi1> {{
    %r = stablehlo.iota dim = 0 : tensor<{T}x{T}xi32>
    %c = stablehlo.iota dim = 1 : tensor<{T}x{T}xi32>
    %m = stablehlo.compare GE, %r, %c : (tensor<{T}x{T}xi32>, tensor<{T}x{T}xi32>) -> tensor<{T}x{T}xi1>
    return %m : tensor<{T}x{T}xi1>
  }}""")
    S = f"tensor<{B}x{H}x{T}x{T}xf32>"
    X = f"tensor<{B}x{T}x{H}x{D}xf32>"
    main = f"""
  func.func @main(%q: {X}, %k: {X}, %v: {X}) -> {X} {{
    %s0 = stablehlo.dot_general %q, %k, batching_dims = [0, 2] x [0, 2], contracting_dims = [3] x [3] : ({X}, {X}) -> {S}
    %sc = stablehlo.constant dense<0.176776695> : {S}
    %s = stablehlo.multiply %s0, %sc : {S}
    %mask = func.call @m0() : () -> tensor<{T}x{T}xi1>
    %mb = stablehlo.broadcast_in_dim %mask, dims = [2, 3] : (tensor<{T}x{T}xi1>) -> tensor<{B}x{H}x{T}x{T}xi1>
    %ninf = stablehlo.constant dense<0xFF800000> : {S}
    %sm = stablehlo.select %mb, %s, %ninf : tensor<{B}x{H}x{T}x{T}xi1>, {S}
    %minit = stablehlo.constant dense<0xFF800000> : tensor<f32>
    %mx = stablehlo.reduce(%sm init: %minit) applies stablehlo.maximum across dimensions = [3] : ({S}, tensor<f32>) -> tensor<{B}x{H}x{T}xf32>
    %mxb = stablehlo.broadcast_in_dim %mx, dims = [0, 1, 2] : (tensor<{B}x{H}x{T}xf32>) -> {S}
    %d = stablehlo.subtract %sm, %mxb : {S}
    %e = stablehlo.exponential %d : {S}
    %zero = stablehlo.constant dense<0.0> : tensor<f32>
    %sum = stablehlo.reduce(%e init: %zero) applies stablehlo.add across dimensions = [3] : ({S}, tensor<f32>) -> tensor<{B}x{H}x{T}xf32>
    %sb = stablehlo.broadcast_in_dim %sum, dims = [0, 1, 2] : (tensor<{B}x{H}x{T}xf32>) -> {S}
    %p = stablehlo.divide %e, %sb : {S}
    %o = stablehlo.dot_general %p, %v, batching_dims = [0, 1] x [0, 2], contracting_dims = [3] x [1] : ({S}, {X}) -> tensor<{B}x{H}x{T}x{D}xf32>
    %ot = stablehlo.transpose %o, dims = [0, 2, 1, 3] : (tensor<{B}x{H}x{T}x{D}xf32>) -> {X}
    return %ot : {X}
  }}"""
    return "module {" + main + "".join(funcs) + "\n}\n"


def test_deep_call_chain_is_seen_through_and_erased():
    result = fr.rewrite(_call_chain(LAYERS))
    assert len(result.rewritten) == 1 and result.rewritten[0].causal
    text = result.to_bytes().decode()
    assert "func.call" not in text and "@m0" not in text  # the dead chain is gone


# ------------------------------------------------------------------------------ nesting
def _nested_regions(depth: int) -> str:
    lines = ["func.func @main(%i: tensor<i32>, %x: tensor<f32>) -> tensor<f32> {"]
    lines += [f'%r{d} = "stablehlo.case"(%i) ({{' for d in range(depth)]
    lines.append('"stablehlo.return"(%x) : (tensor<f32>) -> ()')
    for d in reversed(range(depth)):
        lines.append("}) : (tensor<i32>) -> tensor<f32>")
        if d:
            lines.append(f'"stablehlo.return"(%r{d}) : (tensor<f32>) -> ()')
    lines.append("return %r0 : tensor<f32>\n}")
    return "\n".join(lines) + "\n"


def _in_child(code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout)


def _deep(kind: str, n: int) -> str:
    if kind == "regions":
        return _nested_regions(n)
    if kind == "array attribute":
        return ("func.func @main(%x: tensor<f32>) -> tensor<f32> attributes {a = " + "[" * n
                + "]" * n + "} {\n  return %x : tensor<f32>\n}\n")
    return ("func.func @main(%x: tensor<f32>) -> tensor<f32> {\n  return %x : tensor<f32> loc("
            + "callsite(" * n + '"a"' + ' at "b")' * n + ")\n}\n")


@pytest.mark.parametrize("kind", ["regions", "array attribute", "location"])
def test_deep_text_refused_before_parsing(tmp_path, kind):
    path = tmp_path / "deep.mlir"
    path.write_text(_deep(kind, 5000))
    proc = _in_child(f"""
        import sys
        from flashgen import cli
        sys.exit(cli.main(["rewrite", {str(path)!r}]))
    """)
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    assert "nested" in proc.stderr and "Traceback" not in proc.stderr


def test_ordinary_nesting_still_loads():
    loaded = modules.load(_nested_regions(50))
    assert loaded.format == "mlir"


def _deep_bytecode(text: str) -> bytes:
    """Bytecode of a deeply nested module, parsed on a thread with a stack big enough for it."""
    out = {}

    def work():
        from jaxlib.mlir import ir
        from flashgen.mlir_context import new_context
        with new_context():
            m = ir.Module.parse(text)
            buf = io.BytesIO()
            m.operation.write_bytecode(buf)
            out["data"] = buf.getvalue()

    old = threading.stack_size(1 << 30)
    try:
        t = threading.Thread(target=work)
        t.start()
        t.join()
    finally:
        threading.stack_size(old)
    return out["data"]


@pytest.mark.parametrize("kind,depth", [("regions", 5000), ("array attribute", 5000),
                                        ("location", 30000)])  # prints fail: the probe dies
def test_deep_bytecode_refused_without_crash(tmp_path, kind, depth):
    path = tmp_path / "deep.mlirbc"
    path.write_bytes(_deep_bytecode(_deep(kind, depth)))
    proc = _in_child(f"""
        import sys
        from flashgen import cli
        sys.exit(cli.main(["rewrite", {str(path)!r}, "-o", {str(tmp_path / "o.mlir")!r},
                           "--output-format", "mlir"]))
    """)
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    # 30,000 deep the probe's own printer overflows: the probe dies and the input is refused
    assert ("crashed (SIGSEGV)" if depth > 10000 else "nested") in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "o.mlir").exists()


def test_load_error_names_the_depth():
    with pytest.raises(LoadError, match=r"nested \d+ deep"):
        modules.load(_nested_regions(2500))
