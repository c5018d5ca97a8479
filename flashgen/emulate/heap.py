"""Python's cyclic garbage collector, kept out of the emulator's hot paths.

Parsing a library's PTX creates some 10^5 long-lived objects (instructions, operands), and
compiling and running a kernel allocates closures and small containers at a pace that makes the
collector scan all of them again and again: measured, half of a small launch's time (the dense
pace case: 0.76 s with the collector, 0.29 s without) and half of parsing. Parsing and launches
run with it paused; what they leave in cycles (a wave's warps and CTAs, see machine._Wave.close)
is broken explicitly, so that memory does not grow while it is paused.
"""
from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def collector_paused():
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def keep_forever() -> None:
    """Exempt every object alive now from later collections (called once a library's PTX is parsed
    and cached for the process: its objects are scanned for nothing otherwise). Pausing launches is
    not enough: the first collection after a launch scans what is not frozen, and without this the
    dense and extras pace cases ran at 0.6-0.7x (interleaved, same machine). Garbage is collected
    first, so that none is kept forever. (Freezing again after each kernel's compile measured
    1.0-1.1x: not done.)"""
    gc.collect()
    gc.freeze()
