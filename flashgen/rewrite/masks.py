"""Is a mask a causal mask, and aligned how?

A mask is evaluated to a boolean "visible" tensor (flashgen.rewrite.fold) in the
layout of the scores where it applied. Every axis it is constant along is dropped;
what remains must vary along one query axis and one key axis only, and equal
``j <= i`` (top-left) or ``j <= i + Sk - Sq`` (bottom-right) with no fully masked row.
Anything else (sliding windows, padding, block masks) is rejected with the reason.
"""
from __future__ import annotations

import numpy as np

from flashgen.rewrite import layout as L
from flashgen.rewrite.errors import Reject


def classify(masks, cuts, q_free, k_free):
    """(causal, bottom_right, [query sequence piece]) from the recorded masks.

    ``masks``: (Const of visible positions, layout where it applied, how) per mask;
    ``q_free``/``k_free``: the refined pieces of the query and key axes.
    """
    if not masks:
        return False, False, []
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
                raise Reject("the mask is not causal: it varies along "
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
            raise Reject("the masks vary along different axes")
        q_axis, k_axis = q_axis or qa, k_axis or ka
        combined = arr2 if combined is None else (combined & arr2)
    if combined.all():
        return False, False, []
    single_query = not q_free  # one query row (a decode step): the mask varies along keys only
    if k_axis is None or (q_axis is None and not single_query):
        raise Reject("the mask is not causal (it depends on only one of the query and key "
                     "positions: a padding mask?)")
    if len(k_free) != 1:
        raise Reject("a causal mask over several key axes is not supported")
    sq, sk = (1 if q_axis is None else q_axis[2]), k_axis[2]
    full = np.broadcast_to(combined, (sq, sk))
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    if np.array_equal(full, j <= i):
        bottom_right = False
    elif np.array_equal(full, j <= i + (sk - sq)):
        bottom_right = True
    else:
        raise Reject("the mask is not causal (sliding window, block or other pattern): "
                     "unsupported")
    if not full.any(axis=1).all():
        raise Reject("the causal mask leaves rows with no visible key")
    return True, bottom_right, [q_axis] if q_axis is not None else []
