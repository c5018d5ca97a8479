"""Import torchax under torch releases that removed ATen overloads it names.

torchax 0.0.13 (the latest release) lists a few dozen named-tensor ("Dimname")
ATen overloads -- ``aten.prod.dim_Dimname``, ``aten.unbind.Dimname``,
``aten.std.names_dim``, ... -- in two module-level tables: its autocast policy
(``torchax/amp.py``) and the list of ops it asks ``torch._decomp`` to decompose
(``torchax/decompositions.py``). torch 2.13 removed those overloads, so
``torch.ops.aten.prod.dim_Dimname`` raises AttributeError and ``import torchax``
fails before anything runs.

This module is the workaround, and it is deliberate: nothing in flashgen imports
torchax any other way. Use it instead of ``import torchax``:

    from flashgen.frontends.torchax_compat import import_torchax
    torchax = import_torchax()            # torchax, with torchax.export loaded
    torchax_compat.missing_overloads()    # what was papered over (empty if nothing)

What it does:

1. ``import torchax`` plainly. With a torch that still has every overload torchax
   names, that is all; nothing is patched.
2. Only if that import fails *because an overload is missing*, it forgets the
   half-imported torchax modules and imports again while
   ``torch._ops.OpOverloadPacket.__getattr__`` answers a missing, public overload
   name with an inert :class:`MissingOverload` placeholder instead of raising.
   The original ``__getattr__`` is restored as soon as the import returns
   (also on error), so torch behaves exactly as shipped afterwards.

Why the placeholders are harmless: they are only ever dictionary keys (the
autocast table, looked up by real ``OpOverload`` objects, which never equal a
placeholder) or entries in the list given to ``torch._decomp.get_decompositions``,
which ignores anything that is not a registered operator. The overloads they
stand for do not exist in this torch, so no exported graph can contain them.
Calling a placeholder raises.

Versions checked: torch 2.13.0 (CPU) with torchax 0.0.13 and jax 0.10.2 -- 21
overloads missing. Any other failure (a missing module, an incompatible jax) is
raised unchanged.
"""
from __future__ import annotations

import contextlib
import importlib
import sys
import threading

__all__ = ["import_torchax", "missing_overloads", "MissingOverload"]

_lock = threading.Lock()
_missing: list[tuple[str, str]] = []


class MissingOverload:
    """Stands for an ATen overload that this torch does not have."""

    __slots__ = ("packet", "name")

    def __init__(self, packet: str, name: str):
        self.packet, self.name = packet, name

    def __repr__(self) -> str:
        return f"<MissingOverload {self.packet}.{self.name}>"

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self.packet}.{self.name} does not exist in torch "
                           f"{_torch_version()}; torchax listed it, flashgen's compat shim "
                           "stood in for it (flashgen/frontends/torchax_compat.py)")


def _torch_version() -> str:
    import torch
    return torch.__version__


def missing_overloads() -> list[tuple[str, str]]:
    """(packet, overload) pairs the last shimmed import stood in for; [] if none was needed."""
    return list(_missing)


def _is_missing_overload(err: BaseException) -> bool:
    return isinstance(err, AttributeError) and "has no overload name" in str(err)


def _forget_torchax() -> None:
    for name in [m for m in sys.modules if m == "torchax" or m.startswith("torchax.")]:
        del sys.modules[name]


@contextlib.contextmanager
def _lenient_overloads(record: list):
    import torch._ops as ops
    original = ops.OpOverloadPacket.__getattr__

    def getattr_(self, key):
        try:
            return original(self, key)
        except AttributeError:
            if key.startswith("_"):
                raise
            record.append((str(self), key))
            return MissingOverload(str(self), key)

    ops.OpOverloadPacket.__getattr__ = getattr_
    try:
        yield
    finally:
        ops.OpOverloadPacket.__getattr__ = original


def import_torchax():
    """Return the torchax module (with ``torchax.export`` imported); see the module doc."""
    with _lock:
        if "torchax.export" in sys.modules:
            return sys.modules["torchax"]
        try:
            importlib.import_module("torchax")
            importlib.import_module("torchax.export")
            return sys.modules["torchax"]
        except AttributeError as e:
            if not _is_missing_overload(e):
                raise
        _forget_torchax()
        record: list = []
        with _lenient_overloads(record):
            try:
                importlib.import_module("torchax")
                importlib.import_module("torchax.export")
            except BaseException:
                _forget_torchax()
                raise
        _missing[:] = sorted(set(record))
        return sys.modules["torchax"]
