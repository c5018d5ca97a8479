"""flashgen: FlashAttention kernels generated per spec, called from StableHLO.

Data flow: spec -> codegen -> build (content cache) -> emit -> rewrite -> runtime.
"""
from flashgen.build import BuildError, Library, build
from flashgen.spec import DTYPES, HEAD_DIMS, KernelSpec, target_name
from flashgen.targets import TARGETS

__version__ = "0.1.0"


def emit_custom_call(*args, **kwargs):
    """See flashgen.emit.emit_custom_call (imported lazily: it needs jaxlib)."""
    from flashgen.emit import emit_custom_call as _emit
    return _emit(*args, **kwargs)


def __getattr__(name):
    """``flashgen.rewrite(...)``: the rewrite package, callable, imported on first use."""
    if name == "rewrite":
        import importlib
        return importlib.import_module("flashgen.rewrite")
    raise AttributeError(f"module 'flashgen' has no attribute {name!r}")


__all__ = ["KernelSpec", "build", "Library", "BuildError", "emit_custom_call", "target_name",
           "HEAD_DIMS", "DTYPES", "TARGETS", "__version__"]
