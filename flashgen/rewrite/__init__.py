"""Find attention in StableHLO programs and replace it with flashgen custom calls.

    result = flashgen.rewrite.rewrite("model.mlir")      # or bytes, text, an ir.Module
    result.sites       # AttentionSite (rewritten) and Rejection records
    result.to_bytes()  # the module in the input's format
    result.specs       # the KernelSpecs the rewritten module needs

``flashgen.rewrite(...)`` (the package called like a function) is the same call.
Modules: modules (formats), graph (navigation through calls), fold (constant
evaluation), layout (axis bookkeeping), patterns (match/rewrite) built from its
stages scores, softmax, probabilities and roles (chain: what the stages share), variants (one
module per score modifier / mask form: its recognizer and its plan step), plan (the Plan: the
composition of the variants' steps), masks (causal / window bands), extras (ALiBi, bias, mask
and segment-id operands), adapters (layout ops), driver (applies the pattern), instances and polymorphic (shape-polymorphic
modules: matched on static instances, rewritten with a dynamic custom call), report (the records).
"""
from __future__ import annotations

import dataclasses
import sys
import time
import types
from typing import Any, Optional

from flashgen.rewrite.report import AttentionSite, Rejection, Report

__all__ = ["rewrite", "RewriteResult", "AttentionSite", "Rejection", "Report"]


@dataclasses.dataclass
class RewriteResult:
    module: Any                 # jaxlib.mlir.ir.Module (rewritten in place of a parsed copy)
    sites: list                 # AttentionSite | Rejection, in program order
    format: str                 # mlir | mlirbc | portable | jax_exported
    seconds: float = 0.0
    notes: list = dataclasses.field(default_factory=list)
    loaded: Any = dataclasses.field(default=None, repr=False)

    @property
    def rewritten(self) -> list:
        return [s for s in self.sites if isinstance(s, AttentionSite) and s.status == "rewritten"]

    @property
    def rejected(self) -> list:
        return [s for s in self.sites if s.status == "rejected"]

    @property
    def changed(self) -> bool:
        return bool(self.rewritten)

    @property
    def specs(self) -> list:
        from flashgen.spec import KernelSpec
        return sorted({KernelSpec.from_json(s.spec) for s in self.rewritten})

    def to_bytes(self) -> bytes:
        """The module in the input's format; the input itself when nothing changed."""
        from flashgen.rewrite import modules
        if not self.changed:
            return self.loaded.data
        return modules.dump(self.loaded, self.module,
                            extra_custom_calls=tuple(sorted(
                                {t for s in self.rewritten for t in (s.target, s.backward_target)
                                 if t})))

    def text(self) -> str:
        from flashgen.rewrite import modules
        with self.loaded.context:
            return modules.module_text(self.module, True)

    def report(self, input: Optional[str] = None, output: Optional[str] = None) -> Report:
        return Report(input=input, output=output, format=self.format, sites=list(self.sites),
                      seconds=self.seconds, specs=[s.to_json() for s in self.specs],
                      notes=list(self.notes))


def rewrite(source, *, legacy_attrs: bool = False, target: str = "cpu") -> RewriteResult:
    """Rewrite every attention site of a module.

    ``source``: a path, the file's bytes, StableHLO text, or a jaxlib ``ir.Module``
    (which is copied, not changed). ``legacy_attrs`` emits the mhlo.backend_config
    form; ``target`` is the KernelSpec target the report names (the custom-call target
    names do not depend on it). Raises LoadError for unreadable input.
    """
    from flashgen.rewrite import driver, instances, modules, polymorphic
    t0 = time.perf_counter()
    loaded = _load(source)
    notes = []
    if loaded.version and not modules.version_at_least(loaded.version, "1.3.0") and not legacy_attrs:
        legacy_attrs = True
        notes.append(f"StableHLO {loaded.version} predates typed backend_config dictionaries: "
                     "emitting the legacy mhlo.backend_config form")
    with loaded.context:
        options = driver.RewriteOptions(legacy_attrs, target)
        sites = (polymorphic.rewrite_module if instances.is_polymorphic(loaded.module)
                 else driver.rewrite_module)(loaded.module, options)
    return RewriteResult(loaded.module, sites, loaded.format, time.perf_counter() - t0, notes,
                         loaded)


def _load(source):
    from flashgen.rewrite import modules
    try:
        from jaxlib.mlir import ir
    except ImportError:  # pragma: no cover - jaxlib is a dependency
        ir = None
    if ir is not None and isinstance(source, ir.Module):
        text = modules.module_text(source, True)
        return modules.load(text)
    return modules.load(source)


class _CallablePackage(types.ModuleType):
    """Lets ``flashgen.rewrite(...)`` call ``flashgen.rewrite.rewrite(...)``."""

    def __call__(self, *args, **kwargs):
        return rewrite(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
