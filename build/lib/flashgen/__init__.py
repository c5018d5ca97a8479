"""flashgen: FlashAttention kernels generated per spec, called from StableHLO.

Data flow: spec -> codegen -> build (content cache) -> emit -> rewrite -> runtime.
"""
from flashgen.build import BuildError, Library, build
from flashgen.spec import DTYPES, HEAD_DIMS, TARGETS, KernelSpec, target_name

__version__ = "0.1.0"


def emit_custom_call(*args, **kwargs):
    """See flashgen.emit.emit_custom_call (imported lazily: it needs jaxlib)."""
    from flashgen.emit import emit_custom_call as _emit
    return _emit(*args, **kwargs)


__all__ = ["KernelSpec", "build", "Library", "BuildError", "emit_custom_call", "target_name",
           "HEAD_DIMS", "DTYPES", "TARGETS", "__version__"]
