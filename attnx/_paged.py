"""Packed sequences against keys and values in pages (a paged KV cache), read
in place: ``varlen_attention(..., block_table=...)``.

The pools hold ``num_blocks`` pages of ``block_size`` rows each,
(num_blocks, block_size, Hk, E); sequence n's keys are the first
``cu_seqlens_k[n+1] - cu_seqlens_k[n]`` rows of its pages
``block_table[n, 0], block_table[n, 1], ...`` in order (flash-attn's
``flash_attn_varlen_func(..., block_table=...)``). Everything is checked
here, then one call of the extension runs every sequence with the GIL
released (``_attnx.forward_varlen``): each sequence is one problem of the C
core, whose tiles of keys stop at page boundaries and read the pages where
they are. No key is gathered or copied.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import numpy as np
from numpy.typing import NDArray

from . import _attnx
from ._int8 import rotate, rotate_back, shift_lse
from ._args import (F32, as_array, attention_args, check_alibi_range, float_array, integer_array,
                    is_bfloat16, shape_str, small_float_array, unit_last_stride)

__all__ = ["cu_seqlens", "paged_forward"]


def cu_seqlens(x: object, name: str, total: Optional[int]) -> NDArray[np.int64]:
    """``cu_seqlens`` checked: 1-D integers, starting at 0, non-decreasing, ending at
    ``total`` (None: anywhere, as cu_seqlens_k with pages). A private int64 copy:
    the core reads it without the GIL. (attnx._varlen's packed batches use it too.)"""
    a = integer_array(x, name)
    if a.ndim != 1 or a.shape[0] < 1:
        raise ValueError(f"{name} must be 1-D (N+1,) with at least one entry; got shape {shape_str(a)}")
    if a.size and a.dtype.kind == "u" and a.max() > np.iinfo(np.int64).max:
        raise ValueError(f"{name} holds {a.max()}, beyond any packed length (int64); got "
                         f"{a.tolist()}")
    c = np.array(a, dtype=np.int64)
    if c[0] != 0:
        raise ValueError(f"{name} must start at 0; got {c[0]}")
    if np.any(np.diff(c) < 0):
        raise ValueError(f"{name} must be non-decreasing; got {c.tolist()}")
    if total is not None and c[-1] != total:
        raise ValueError(f"{name} must end at the packed length {total}; got {c[-1]}")
    return c


def _int8_pool(x: Tuple[object, ...], name: str,
               ) -> Tuple[NDArray[Any], NDArray[Any], Optional[NDArray[np.float64]],
                          Optional[NDArray[Any]]]:
    """An int8 pool given as ``(pages, scales)``, ``(pages, scales,
    rotation)`` or, for keys, ``(pages, scales, rotation, centers)``: int8
    (num_blocks, block_size, Hk, E), float32 scales (num_blocks, block_size,
    Hk), a rotation (E, E) or None, and centers (N, Hk, E) or None, each page
    row of sequence i standing for ``rotation.T @ (scale * int8) +
    centers[i]`` (``scale * int8`` without a rotation; an int8 attnx.KVCache
    row with its ``k_rotation`` and ``k_center``). The centers are checked
    by the caller, who knows N."""
    if len(x) not in ((2, 3, 4) if name == "key" else (2, 3)):
        raise ValueError(f"{name} as a tuple must be (int8 pages, scales) or (int8 pages, scales, "
                         f"rotation){' or (..., rotation, centers)' if name == 'key' else ''}; "
                         f"got {len(x)} items")
    pages, scales = (as_array(a, f"{name}[{i}]") for i, a in enumerate(x[:2]))
    if pages.dtype != np.int8 or pages.ndim != 4:
        raise ValueError(f"{name}[0] must be int8 pages (num_blocks, block_size, H, E); got "
                         f"{pages.dtype} {shape_str(pages)}")
    if scales.shape != pages.shape[:3] or scales.dtype.kind != "f":
        raise ValueError(f"{name}[1] must be float32 scales {pages.shape[:3]} (num_blocks, "
                         f"block_size, H); got {scales.dtype} {shape_str(scales)}")
    rotation = None
    if len(x) >= 3 and x[2] is not None:
        E = pages.shape[3]
        rotation = np.asarray(as_array(x[2], f"{name}[2]"))
        if rotation.shape != (E, E) or rotation.dtype.kind not in "fiu" \
                or not np.isfinite(rotation).all():
            raise ValueError(f"{name}[2] must be a finite rotation ({E}, {E}) (E, E), as "
                             f"attnx.int8_rotation({E}) gives; got {rotation.dtype} "
                             f"{shape_str(rotation)}")
        rotation = rotation.astype(np.float64)
    centers = None if len(x) < 4 or x[3] is None else as_array(x[3], f"{name}[3]")
    # scales as the core reads them: C-contiguous float32, aligned (a misaligned
    # view of float32 is a valid layout, which ascontiguousarray would keep)
    return unit_last_stride(pages), np.require(scales, np.float32, ["C", "A"]), rotation, \
        centers


def _pools(key: object, value: object) -> Tuple[Any, Any, Any, Any, Any]:
    """The pools as the core reads them, (num_blocks, Hk, block_size, E) views:
    float16 pairs and bfloat16 pairs (as uint16 bits) as they are, float32 as
    it is; other float dtypes converted to float32 (a copy); int8 pools
    (``(pages, scales[, rotation])`` tuples) as ``(pages, scales[..., None])``
    views. Then the key's and the value's rotations and the keys' centers
    (None without)."""
    if isinstance(key, tuple) or isinstance(value, tuple):
        if not (isinstance(key, tuple) and isinstance(value, tuple)):
            raise TypeError("key and value must both be (int8 pages, scales) tuples, or arrays")
        (kp, ks, kr, kc), (vp, vs, vr, _) = _int8_pool(key, "key"), _int8_pool(value, "value")
        if kp.shape[:3] != vp.shape[:3]:
            raise ValueError(f"key and value pages must agree in (num_blocks, block_size, Hk); "
                             f"got key {shape_str(kp)}, value {shape_str(vp)}")
        _check_pool_shape(kp)
        return ((kp.swapaxes(1, 2), ks.swapaxes(1, 2)[..., None]),
                (vp.swapaxes(1, 2), vs.swapaxes(1, 2)[..., None]), kr, vr, kc)
    k, v = float_array(key, "key"), float_array(value, "value")
    for a, n in ((k, "key"), (v, "value")):
        if a.ndim != 4:
            raise ValueError(f"with block_table, {n} must be pages (num_blocks, block_size, H, E); "
                             f"got shape {shape_str(a)}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"key and value pages must agree in (num_blocks, block_size, Hk); got key "
                         f"{shape_str(k)}, value {shape_str(v)}")
    _check_pool_shape(k)
    if k.dtype == v.dtype and is_bfloat16(k.dtype):
        k, v = k.view(np.uint16), v.view(np.uint16)
    elif not (k.dtype == v.dtype == np.float16):
        k, v = k.astype(np.float32, copy=False), v.astype(np.float32, copy=False)
    return (unit_last_stride(k).swapaxes(1, 2), unit_last_stride(v).swapaxes(1, 2), None, None,
            None)


def _pool_shapes(key: object, value: object) -> str:
    """The pools' shapes as the caller passed them, for errors."""
    def one(x: object, name: str) -> str:
        if isinstance(x, tuple):
            parts = ", ".join(shape_str(np.asarray(a)) for a in x)
            items = ("int8 pages", "scales", "rotation", "centers")[:len(x)]
            return f"{name} ({parts}) ({', '.join(items)})"
        return f"{name} {shape_str(np.asarray(x))}"
    return f"{one(key, 'key')}, {one(value, 'value')} (num_blocks, block_size, Hk, E)"


def _check_pool_shape(k: NDArray[Any]) -> None:
    if k.shape[1] < 1:
        raise ValueError(f"pages must hold at least one row (block_size >= 1); got key {shape_str(k)}")
    if k.shape[0] > np.iinfo(np.int32).max:
        raise ValueError(f"at most 2**31 - 1 pages (block_table is int32); got key {shape_str(k)}")


def _table(block_table: object, lengths: NDArray[np.int64], num_blocks: int,
           block_size: int) -> NDArray[np.int32]:
    """block_table checked against each sequence's keys: (N, max_blocks) integers,
    enough columns for every sequence, the used entries in [0, num_blocks). An
    int32 private copy."""
    t = integer_array(block_table, "block_table")
    n = lengths.shape[0]
    if t.ndim != 2 or t.shape[0] != n:
        raise ValueError(f"block_table must be (num_seqs, max_blocks) = ({n}, max_blocks); got "
                         f"shape {shape_str(t)}")
    need = -(-lengths // block_size)                     # pages each sequence's keys fill
    if n and need.max(initial=0) > t.shape[1]:
        i = int(np.argmax(need > t.shape[1]))
        raise ValueError(f"block_table: sequence {i} has {lengths[i]} keys, {need[i]} pages of "
                         f"{block_size} rows, but the table has {t.shape[1]} columns")
    used = np.arange(t.shape[1]) < need[:, None]
    bad = used & ((t < 0) | (t >= num_blocks))
    if bad.any():
        i, j = (int(x[0]) for x in np.nonzero(bad))
        pools = (f"the pools hold {num_blocks} pages (0 to {num_blocks - 1})" if num_blocks else
                 f"the pools hold no page (key and value have num_blocks = 0), and sequence {i} "
                 f"has {lengths[i]} keys")
        raise ValueError(f"block_table[{i}, {j}] = {t[i, j]} names no page: {pools}")
    return np.array(np.where(used, t, 0), dtype=np.int32)  # unused entries: never read


def _per_sequence(x: object, name: str, n: int, Hq: int) -> Optional[NDArray[np.float32]]:
    """sinks or alibi_slopes, (Hq,) or (N, Hq), as an (N, Hq) float32 array,
    every row finite (the core reads them all)."""
    if x is None:
        return None
    a = small_float_array(x, name)
    if a.shape not in ((Hq,), (n, Hq)):
        raise ValueError(f"{name} must be (Hq,) = ({Hq},) or (N, Hq) = ({n}, {Hq}); got shape "
                         f"{shape_str(a)}")
    rows = np.ascontiguousarray(np.broadcast_to(a, (n, Hq)), dtype=np.float32)
    if not np.isfinite(rows).all():
        raise ValueError(f"{name} must be finite in float32; got {a.tolist()!r:.200}")
    return rows


def paged_forward(query: object, key: object, value: object, cu_seqlens_q: object,
                  cu_seqlens_k: object, block_table: object, opts: dict[str, Any],
                  sinks: object, alibi_slopes: object,
                  threads: Callable[[], int]) -> Tuple[F32, F32]:
    """out (total_q, Hq, Ev) and lse (Hq, total_q) of varlen_attention with pages."""
    q = float_array(query, "query")
    if q.ndim != 3:
        raise ValueError(f"query must be packed (total, H, E); got shape {shape_str(q)}")
    kp, vp, k_rotation, v_rotation, centers = _pools(key, value)
    q_given = q
    q = rotate(q, k_rotation)      # rows stand for Rᵀy: q · Rᵀy = (R q) · y, y read as stored
    kpages, vpages = (kp[0], vp[0]) if isinstance(kp, tuple) else (kp, vp)
    num_blocks, Hk, block_size = kpages.shape[:3]
    cq = cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.shape[0])
    ck = cu_seqlens(cu_seqlens_k, "cu_seqlens_k", None)
    if cq.shape != ck.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (N+1); got "
                         f"{cq.shape[0]} and {ck.shape[0]}")
    n, Hq = cq.shape[0] - 1, q.shape[1]
    lengths = np.diff(ck)
    table = _table(block_table, lengths, num_blocks, block_size)
    s = _per_sequence(sinks, "sinks", n, Hq)
    a = _per_sequence(alibi_slopes, "alibi_slopes", n, Hq)
    # every shared check once, on zero-row views (heads, widths, the options)
    # (errors name the arrays as passed: query (total, Hq, E), the pools' pages)
    k0 = np.zeros((1, 0, Hk, kpages.shape[3]), np.float32)
    v0 = np.zeros((1, 0, Hk, vpages.shape[3]), np.float32)
    p = attention_args(q[None], k0, v0, layout="blhd", **opts,
                       sinks=None if s is None or n == 0 else s[0],
                       alibi_slopes=None if a is None or n == 0 else a[0],
                       shown_as=f"query {shape_str(q)} (total, Hq, E), {_pool_shapes(key, value)}")
    p = p.astype(np.float32)
    if a is not None:
        lq = np.diff(cq)
        for i in range(n):
            check_alibi_range(a[i], p.variants.align, int(lq[i]), int(lengths[i]))
    Ev = vpages.shape[3]
    out = np.empty((q.shape[0], Hq, Ev), np.float32)
    lse = np.empty((Hq, q.shape[0]), np.float32)
    c = None if centers is None else _centers(centers, n, Hk, kpages.shape[3], p.variants.softcap)
    core_sinks = s if c is None else None     # with centres: joined after the lse's shift
    _attnx.forward_varlen(p.q, kp, vp, out.swapaxes(0, 1)[None], lse[None, :, :, None], cq, ck,
                          table, p.causal, p.scale, p.variants.core(a, core_sinks), threads(),
                          p.q_bfloat16)
    out = rotate_back(out, v_rotation)
    if c is not None:
        return _recenter_packed(out, lse, q_given, c, np.diff(cq), p.scale, s)
    return out, lse


def _centers(x: NDArray[Any], n: int, Hk: int, E: int, softcap: float) -> NDArray[np.float64]:
    """The key pool's centers, checked: (N, Hk, E), finite; refused with softcap
    (under tanh the centre's shift of a row's scores does not cancel)."""
    if x.shape != (n, Hk, E) or x.dtype.kind not in "fiu" or not np.isfinite(x).all():
        raise ValueError(f"key[3] must be finite centers ({n}, {Hk}, {E}) (N, Hk, E), one a "
                         f"sequence (its KVCache k_center); got {x.dtype} {shape_str(x)}")
    if softcap:
        raise ValueError("softcap needs the scores themselves, and centred key pages hold keys "
                         "minus a centre (its shift cancels in a softmax, not under tanh): pass "
                         "pages filled without a centre")
    return x.astype(np.float64)


def _recenter_packed(out: F32, lse: F32, q: NDArray[Any], centers: NDArray[np.float64],
                     lq: NDArray[np.int64], scale: float, sinks: Optional[NDArray[Any]],
                     ) -> Tuple[F32, F32]:
    """Packed out (total, Hq, Ev) and lse (Hq, total), computed without sinks
    over keys minus their sequence's centre, as over the keys: each row's lse
    gains ``scale · q · centers[i]`` (the shift the softmax cancelled), then
    the sinks (N, Hq) join each row's denominator. q (total, Hq, E)."""
    seq = np.repeat(np.arange(len(lq)), lq)                               # (total,)
    Hq, Hk = q.shape[1], centers.shape[1]
    g = centers[seq].repeat(Hq // Hk, axis=1)                             # (total, Hq, E)
    shift = scale * np.einsum("the,the->ht", q.astype(np.float64), g)     # (Hq, total)
    row_sinks = None if sinks is None else np.asarray(sinks, np.float64)[seq].T   # (Hq, total)
    lse64, w = shift_lse(lse, shift, row_sinks)
    if w is not None:
        out = (out * w.T[..., None]).astype(np.float32)
    return out, lse64.astype(np.float32)
