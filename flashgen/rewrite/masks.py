"""Is a mask a causal or sliding-window mask, and aligned how?

A mask is evaluated to a boolean "visible" tensor (flashgen.rewrite.fold) in the
layout of the scores where it applied. Every axis it is constant along is dropped;
what remains must vary along one query axis and one key axis only, and be a band
on the diagonal distance: visible iff ``lo <= j - i - off <= hi`` with off = 0
(top-left) or Sk - Sq (bottom-right). hi = 0 is causal,
hi > 0 a window's right side, lo a window's left side (left = -lo); an unbounded
side is -1. Anything else (padding, block masks, hi < 0) raises NotBand with the reason; the
pattern then passes the mask as a constant ``mask`` operand (flashgen.rewrite.extras).
"""
from __future__ import annotations

import numpy as np

from flashgen.rewrite import layout as L
from flashgen.rewrite.errors import Reject


class NotBand(Reject):
    """The constant masks are valid but no causal/window band: pass them as a mask operand."""


def classify(masks, cuts, q_free, k_free):
    """(causal, bottom_right, [query sequence piece], window) from the recorded masks;
    window = (left, right), -1 = unbounded.

    ``masks``: (Const of visible positions, layout where it applied, how) per mask;
    ``q_free``/``k_free``: the refined pieces of the query and key axes.
    """
    if not masks:
        return False, False, [], (-1, -1)
    q_set, k_set = set(q_free), set(k_free)
    combined, q_axis, k_axis = None, None, None
    for const, lay, _ in masks:
        lay = L.refine(lay, cuts)
        arr = const.array
        fine_shape, fine_pieces = [], []
        for i, d in enumerate(lay):
            if arr.shape[i] == 1:
                fine_shape += [1] * len(d)
            else:
                fine_shape += [pc[2] for pc in d]
            fine_pieces += list(d)
        if not fine_pieces:
            arr = arr.reshape(())
        else:
            arr = arr.reshape(fine_shape)
        qa = ka = None
        for ax, pc in enumerate(fine_pieces):
            if arr.shape[ax] == 1:
                continue
            first = np.take(arr, [0], axis=ax)
            if np.all(arr == first):
                arr = first
                continue
            if pc in q_set and qa is None:
                qa = pc
            elif pc in k_set and ka is None:
                ka = pc
            else:
                raise NotBand("the mask is not causal: it varies along "
                             f"{'a batch or head axis' if pc[0][0] == 'B' else 'several axes'}")
        keep = [ax for ax, pc in enumerate(fine_pieces) if pc in (qa, ka) and arr.shape[ax] > 1]
        arr2 = arr.reshape([arr.shape[ax] for ax in keep]) if keep else arr.reshape(())
        order = [fine_pieces[ax] for ax in keep]
        if order == [ka, qa] and ka is not None and qa is not None:
            arr2 = arr2.T
        if qa is None and ka is not None:
            arr2 = arr2.reshape(1, -1)
        elif ka is None and qa is not None:
            arr2 = arr2.reshape(-1, 1)
        else:
            arr2 = arr2.reshape((1, 1) if not keep else arr2.shape)
        if (q_axis and qa and q_axis != qa) or (k_axis and ka and k_axis != ka):
            raise NotBand("the masks vary along different axes")
        q_axis, k_axis = q_axis or qa, k_axis or ka
        combined = arr2 if combined is None else (combined & arr2)
    if combined.all():
        return False, False, [], (-1, -1)
    single_query = not q_free  # one query row (a decode step): the mask varies along keys only
    if k_axis is None or (q_axis is None and not single_query):
        raise NotBand("the mask is not causal (it depends on only one of the query and key "
                     "positions: a padding mask?)")
    if len(k_free) != 1:
        raise NotBand("a causal mask over several key axes is not supported")
    sq, sk = (1 if q_axis is None else q_axis[2]), k_axis[2]
    full = np.broadcast_to(combined, (sq, sk))
    found = band(full)
    if found is None:
        raise NotBand("the mask is not causal or a sliding window (block, strided or other "
                     "pattern): unsupported")
    causal, bottom_right, window = found
    # rows the band leaves without a visible key (e.g. bottom-right causal with Sq > Sk) are
    # the kernel's too: flashgen.rewrite.empty_rows makes them what the original computes
    return causal, bottom_right, [q_axis] if q_axis is not None else [], window


def band(full: np.ndarray):
    """(causal, bottom_right, (left, right)) whose mask (flashgen.reference.mask) equals
    ``full`` [Sq, Sk], or None. hi = 0 becomes causal (the spec's own flag) rather than a
    window with right = 0; where several forms fit, causal wins, then no left bound, then
    top-left alignment."""
    sq, sk = full.shape
    # per row: the first and last visible key, and whether those in between are all visible
    # (a few passes over the booleans, no Sq x Sk integer temporaries: cheap at S = 8192)
    seen = full.any(axis=1)
    if not seen.any():
        return None
    first = np.argmax(full, axis=1)
    last = sk - 1 - np.argmax(full[:, ::-1], axis=1)
    if not np.array_equal(np.count_nonzero(full, axis=1)[seen], (last - first + 1)[seen]):
        return None
    i = np.arange(sq)
    found = []
    for bottom_right in (False, True):
        off = sk - sq if bottom_right else 0
        lo, hi = int((first - i - off)[seen].min()), int((last - i - off)[seen].max())
        lo_j, hi_j = np.maximum(0, i + off + lo), np.minimum(sk - 1, i + off + hi)
        nonempty = lo_j <= hi_j
        if not (np.array_equal(nonempty, seen) and np.array_equal(first[seen], lo_j[seen])
                and np.array_equal(last[seen], hi_j[seen])):
            continue
        dmin, dmax = -(sq - 1) - off, sk - 1 - off
        if hi >= dmax:
            right = -1
        elif hi >= 0:
            right = hi
        else:
            continue  # the band lies left of the diagonal: no window expresses it
        if lo <= dmin:
            left = -1
        elif lo <= 0:
            left = -lo
        else:
            continue  # the band lies right of the diagonal
        if right == 0:
            found.append((True, bottom_right, (left, -1)))
        else:
            found.append((False, bottom_right, (left, right)))
    if not found:
        return None
    return min(found, key=lambda f: (not f[0], f[2][0] != -1, f[1]))


def visible(sq: int, sk: int, causal: bool, bottom_right: bool, window) -> np.ndarray:
    """[Sq, Sk] visibility of the kernel's causal/window attributes (flashgen.reference)."""
    i = np.arange(sq)[:, None] + ((sk - sq) if bottom_right else 0)
    j = np.arange(sk)[None, :]
    out = np.ones((sq, sk), bool)
    left, right = window
    if causal:
        out &= j <= i
    if right >= 0:
        out &= j <= i + right
    if left >= 0:
        out &= j >= i - left
    return out
