"""Packed variable-length batches (flash-attn's ``varlen`` layout) and
``pack``/``unpack`` between them and padded arrays.

A packed batch concatenates its sequences along one axis: q (total_q, Hq, E)
holds sequence n in rows ``cu_seqlens_q[n]:cu_seqlens_q[n+1]``. Each sequence
is attended alone, as a (1, L, H, E) view in the "blhd" layout: no padding is
stored, copied or computed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, List, Literal, Optional, Sequence, Tuple, Union, overload

import numpy as np
from numpy.typing import NDArray

# (Alignment, Precision, Window: names in the signature that takes() writes)
from ._args import (F32, Alignment, ArrayInput, Causal, Precision, Window, as_array, attention_args,
                    check_flag, float_array, integer_array, nonnegative_int, shape_str,
                    small_float_array)
from ._functional import CALL_THREADS, scaled_dot_product_attention
from ._grad import AttentionGrads, scaled_dot_product_attention_backward
from ._options import Variants, check_names, names, takes
from ._paged import cu_seqlens as _cu_seqlens
from ._paged import paged_forward
from ._saved import Fingerprints

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["varlen_attention", "varlen_attention_vjp", "pack", "unpack"]

#: the keywords of the varlen functions' **options
VARIANTS = names(Variants)


def _per_sequence(x: object, name: str, n: int) -> Callable[[int], Optional[NDArray[Any]]]:
    """A per-head argument: (H,) shared by every sequence, or (N, H), one row each."""
    if x is None:
        return lambda i: None
    a = small_float_array(x, name)
    if a.ndim > 2:
        raise ValueError(f"{name} must be one value, (H,) or (N, H) (a row per sequence); got "
                         f"shape {shape_str(a)}")
    if a.ndim == 2:
        if a.shape[0] != n:
            raise ValueError(f"{name} with shape {shape_str(a)}: a 2-D {name} needs one row per "
                             f"sequence ({n})")
        return lambda i: a[i] if i < n else None   # (N=0: no row for the checks below)
    return lambda i: a


class _Packed:
    """The checked arguments of a varlen call and each sequence's views."""

    def __init__(self, q: object, k: object, v: object, cu_seqlens_q: object,
                 cu_seqlens_k: object, opts: dict[str, Any], sinks: object, alibi_slopes: object):
        self.q, self.k, self.v = (float_array(a, n) for a, n in ((q, "query"), (k, "key"), (v, "value")))
        for a, n in ((self.q, "query"), (self.k, "key"), (self.v, "value")):
            if a.ndim != 3:
                raise ValueError(f"{n} must be packed (total, H, E); got shape {shape_str(a)}")
        self.cq = _cu_seqlens(cu_seqlens_q, "cu_seqlens_q", self.q.shape[0])
        self.ck = _cu_seqlens(cu_seqlens_k, "cu_seqlens_k", self.k.shape[0])
        if self.cq.shape != self.ck.shape:
            raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (N+1); got "
                             f"{self.cq.shape[0]} and {self.ck.shape[0]}")
        if self.v.shape[0] != self.k.shape[0]:
            raise ValueError(f"key and value must have the same packed length; got key "
                             f"{shape_str(self.k)}, value {shape_str(self.v)}")
        self.n = self.cq.shape[0] - 1
        self.opts = opts
        self.sinks = _per_sequence(sinks, "sinks", self.n)
        self.slopes = _per_sequence(alibi_slopes, "alibi_slopes", self.n)
        self.sinks_given = None if sinks is None else as_array(sinks, "sinks")
        # Every shared check once: a batch with no sequence (or none with
        # queries) is checked as one with many. On zero-row views of the packed
        # arrays (heads and widths, no lengths): what depends on a sequence's
        # lengths (ALiBi's bias range) is checked per sequence, where it is
        # computed, not against the packed totals.
        attention_args(self.q[None, :0], self.k[None, :0], self.v[None, :0], layout="blhd",
                       **opts, sinks=self.sinks(0), alibi_slopes=self.slopes(0),
                       shown_as="query {}, key {}, value {} (total, H, E)".format(
                           *(shape_str(a) for a in (self.q, self.k, self.v))))

    def views(self, i: int) -> Tuple[NDArray[Any], NDArray[Any], NDArray[Any]]:
        """Sequence i's (1, L, H, E) views of q, k, v."""
        qs, ks = slice(self.cq[i], self.cq[i + 1]), slice(self.ck[i], self.ck[i + 1])
        return self.q[None, qs], self.k[None, ks], self.v[None, ks]

    def kw(self, i: int) -> dict[str, Any]:
        return dict(self.opts, layout="blhd", sinks=self.sinks(i), alibi_slopes=self.slopes(i))

    def forward(self) -> Tuple[F32, F32]:
        """out (total_q, Hq, Ev) and lse (Hq, total_q)."""
        Hq, Ev = self.q.shape[1], self.v.shape[2]
        out = np.zeros((self.q.shape[0], Hq, Ev), np.float32)
        lse = np.full((Hq, self.q.shape[0]), -np.inf, np.float32)
        for i in range(self.n):
            if self.cq[i + 1] == self.cq[i]:
                continue
            o, l = scaled_dot_product_attention(*self.views(i), return_lse=True, **self.kw(i))
            out[self.cq[i]:self.cq[i + 1]] = o[0]
            lse[:, self.cq[i]:self.cq[i + 1]] = l[0]
        return out, lse


# return_lse=True adds lse; the options are declared once, in attnx._options
@overload
def varlen_attention(query: ArrayInput, key: ArrayInput, value: ArrayInput,
                     cu_seqlens_q: ArrayInput, cu_seqlens_k: ArrayInput, *,
                     scale: Optional[float] = None, is_causal: Causal = False,
                     enable_gqa: bool = False, block_table: Optional[ArrayInput] = None,
                     return_lse: Literal[False] = False,
                     **options: Unpack[Variants]) -> F32: ...
@overload
def varlen_attention(query: ArrayInput, key: ArrayInput, value: ArrayInput,
                     cu_seqlens_q: ArrayInput, cu_seqlens_k: ArrayInput, *,
                     scale: Optional[float] = None, is_causal: Causal = False,
                     enable_gqa: bool = False, block_table: Optional[ArrayInput] = None,
                     return_lse: bool,
                     **options: Unpack[Variants]) -> Union[F32, Tuple[F32, F32]]: ...


@takes(Variants, before="return_lse")
def varlen_attention(query: ArrayInput, key: ArrayInput, value: ArrayInput,
                     cu_seqlens_q: ArrayInput, cu_seqlens_k: ArrayInput, *,
                     scale: Optional[float] = None, is_causal: Causal = False,
                     enable_gqa: bool = False, block_table: Optional[ArrayInput] = None,
                     return_lse: bool = False,
                     **options: Unpack[Variants]) -> Union[F32, Tuple[F32, F32]]:
    """Attention over a packed batch of sequences of different lengths.

    query (total_q, Hq, E), key (total_k, Hk, E), value (total_k, Hk, Ev);
    ``cu_seqlens_q``/``cu_seqlens_k`` (N+1,) int32/int64, starting at 0: sequence
    n is ``query[cu_seqlens_q[n]:cu_seqlens_q[n+1]]`` attending to the keys
    ``cu_seqlens_k[n]:cu_seqlens_k[n+1]`` only (flash-attn's
    ``flash_attn_varlen_func`` layout). Every option means what it means in
    :func:`attnx.scaled_dot_product_attention`, applied to each sequence on its
    own (``is_causal="lower_right"`` and the window use that sequence's
    lengths); ``sinks``/``alibi_slopes`` are (Hq,) or (N, Hq). No padding is
    stored or computed.

    ``block_table`` (N, max_blocks) integers: the keys and values are in pages
    (a paged KV cache), ``key`` and ``value`` (num_blocks, block_size, Hk, E)
    and (num_blocks, block_size, Hk, Ev), float32, float16 or bfloat16, read in
    place (flash-attn's ``block_table``). Sequence n's keys are the first
    ``cu_seqlens_k[n+1] - cu_seqlens_k[n]`` rows of its pages
    ``block_table[n, 0], block_table[n, 1], ...`` in order (``cu_seqlens_k``
    then gives only the lengths; its total is free). Any block_size; entries
    past a sequence's last page are not read. A page outside the pools, or a
    table too short for a sequence, raises ValueError naming it. Decoding rows
    (one query a sequence) and prefill chunks mix freely in one call; with
    ``is_causal="lower_right"`` each sequence's queries are its last
    positions. Forward only (no vjp). Pages may also be int8 with a float32
    scale a row (an int8 cache, see :class:`attnx.KVCache`): pass ``key`` and
    ``value`` as ``(pages, scales, rotation)`` tuples, pages int8
    (num_blocks, block_size, Hk, E), scales (num_blocks, block_size, Hk) and
    rotation (E, E), each row standing for ``rotation.T @ (scale *
    pages[row])``: the format of :class:`attnx.KVCache`'s int8 rows, filled
    with :func:`attnx.quantize_int8` and ``rotation =
    attnx.int8_rotation(E)``; ``(pages, scales)`` rows stand for ``scale *
    pages[row]`` (no rotation). They are read in place too. A key tuple may
    carry a fourth item, ``centers`` (N, Hk, E): then sequence i's key rows
    stand for ``rotation.T @ (scale * pages[row]) + centers[i]`` (keys filled
    minus their sequence's centre, as a KVCache's with its ``k_center``):
    the lse gets each row's shift back and sinks join after it; softcap is
    refused (its tanh does not let the shift cancel).

    Returns out (total_q, Hq, Ev) float32, and with ``return_lse`` also
    lse (Hq, total_q) (flash-attn's varlen layout).

    Example
    -------
    >>> import numpy as np, attnx
    >>> x = np.random.default_rng(0).standard_normal((7, 2, 8), dtype=np.float32)
    >>> cu = np.array([0, 3, 7])                 # two sequences: 3 and 4 tokens
    >>> attnx.varlen_attention(x, x, x, cu, cu, is_causal=True).shape
    (7, 2, 8)
    """
    return_lse = check_flag(return_lse, "return_lse")
    check_names(options, VARIANTS, "varlen_attention")
    opts: dict[str, Any] = dict(options, scale=scale, is_causal=is_causal, enable_gqa=enable_gqa)
    sinks, alibi_slopes = opts.pop("sinks", None), opts.pop("alibi_slopes", None)
    if block_table is not None:
        out, lse = paged_forward(query, key, value, cu_seqlens_q, cu_seqlens_k, block_table, opts,
                                 sinks, alibi_slopes, CALL_THREADS.get)
        return (out, lse) if return_lse else out
    if any(isinstance(x, tuple) and x and isinstance(x[0], np.ndarray) and x[0].dtype == np.int8
           for x in (key, value)):
        raise ValueError("int8 (pages, scales) keys and values need block_table= (a paged "
                         "cache); packed int8 keys are not supported")
    out, lse = _Packed(query, key, value, cu_seqlens_q, cu_seqlens_k, opts, sinks,
                       alibi_slopes).forward()
    return (out, lse) if return_lse else out


@takes(Variants)
def varlen_attention_vjp(query: ArrayInput, key: ArrayInput, value: ArrayInput,
                         cu_seqlens_q: ArrayInput, cu_seqlens_k: ArrayInput, *,
                         scale: Optional[float] = None, is_causal: Causal = False,
                         enable_gqa: bool = False, **options: Unpack[Variants],
                         ) -> Tuple[F32, Callable[[ArrayInput], AttentionGrads]]:
    """:func:`attnx.varlen_attention`'s output and a function of its cotangent.

    Returns ``(out, vjp)``; ``vjp(dout)``, dout (total_q, Hq, Ev), gives
    :class:`attnx.AttentionGrads` with query (total_q, Hq, E), key and value
    shaped like key and value, attn_mask None, and sinks shaped like ``sinks``
    (None without). Padded positions do not exist, so nothing is computed for them.

    The gradients are those of the forward that was computed: ``vjp`` reads a
    private copy of the output (modifying the returned one changes nothing)
    and of sinks and slopes; query, key, value and the cu_seqlens are kept by
    reference with a fingerprint, and ``vjp`` raises RuntimeError naming one
    that was modified in place in between.
    """
    check_names(options, VARIANTS, "varlen_attention_vjp")
    opts: dict[str, Any] = dict(options, scale=scale, is_causal=is_causal, enable_gqa=enable_gqa)
    sinks, alibi_slopes = (None if x is None else np.array(as_array(x, n))   # private copies
                           for x, n in ((opts.pop("sinks", None), "sinks"),
                                        (opts.pop("alibi_slopes", None), "alibi_slopes")))
    pk = _Packed(query, key, value, cu_seqlens_q, cu_seqlens_k, opts, sinks, alibi_slopes)
    out, lse = pk.forward()
    saved_out = out.copy()
    prints = Fingerprints("varlen_attention_vjp", query=pk.q, key=pk.k, value=pk.v,
                          cu_seqlens_q=pk.cq, cu_seqlens_k=pk.ck)

    def vjp(dout: ArrayInput) -> AttentionGrads:
        prints.check()
        do = float_array(dout, "dout")
        if do.shape != out.shape:
            raise ValueError(f"dout must be shaped like the output {out.shape}; got {shape_str(do)}")
        dq = np.zeros(pk.q.shape, np.float32)
        dk = np.zeros(pk.k.shape, np.float32)
        dv = np.zeros(pk.v.shape, np.float32)
        dsinks: List[Optional[NDArray[Any]]] = []
        for i in range(pk.n):
            qs, ks = slice(pk.cq[i], pk.cq[i + 1]), slice(pk.ck[i], pk.ck[i + 1])
            if qs.start == qs.stop:
                dsinks.append(None)
                continue
            g = scaled_dot_product_attention_backward(
                do[None, qs], *pk.views(i), saved_out[None, qs], lse[None, :, qs], **pk.kw(i))
            dq[qs], dk[ks], dv[ks] = g.query[0], g.key[0], g.value[0]
            dsinks.append(g.sinks)
        return AttentionGrads(dq, dk, dv, None, _sum_sinks(dsinks, pk.sinks_given))

    return out, vjp


def _sum_sinks(parts: Sequence[Optional[NDArray[Any]]],
               given: Optional[NDArray[Any]]) -> Optional[NDArray[Any]]:
    """The sinks' gradient: a row each for (N, H) sinks; otherwise (one value, or
    (H,)) summed over the sequences, in float64. Shaped like ``given``."""
    if given is None:
        return None
    if given.ndim == 2:
        H = given.shape[-1]
        rows = [np.zeros(H, np.float32) if p is None else np.reshape(p, H) for p in parts]
        return np.stack(rows).astype(np.float32) if rows else np.zeros(given.shape, np.float32)
    total = np.zeros(given.shape, np.float64)
    for p in parts:
        if p is not None:
            total += np.reshape(p, given.shape)
    return total.astype(np.float32)


def pack(x: ArrayInput, lengths: ArrayInput) -> Tuple[NDArray[Any], NDArray[np.int64]]:
    """A padded batch packed: x (B, L, ...) and lengths (B,) -> (packed, cu_seqlens).

    packed (sum(lengths), ...) holds ``x[b, :lengths[b]]`` one after another;
    cu_seqlens (B+1,) int64 starts at 0. The inverse of :func:`attnx.unpack`.

    >>> import numpy as np, attnx
    >>> x = np.arange(12.0).reshape(2, 3, 2)
    >>> packed, cu = attnx.pack(x, [1, 3])
    >>> packed.shape, cu.tolist()
    ((4, 2), [0, 1, 4])
    """
    a = as_array(x, "x")
    if a.ndim < 2:
        raise ValueError(f"x must be (B, L, ...); got shape {shape_str(a)}")
    n = integer_array(lengths, "lengths")
    if n.shape != (a.shape[0],):
        raise ValueError(f"lengths must be (B,) = ({a.shape[0]},); got shape {shape_str(n)}")
    if n.size and (n.min() < 0 or n.max() > a.shape[1]):
        raise ValueError(f"lengths must lie in [0, L] = [0, {a.shape[1]}]; got {n.tolist()}")
    cu = np.concatenate([[0], np.cumsum(n, dtype=np.int64)]).astype(np.int64)
    packed = np.concatenate([a[b, :int(n[b])] for b in range(a.shape[0])]) if a.shape[0] else \
        np.empty((0,) + a.shape[2:], a.dtype)
    return packed, cu


def unpack(packed: ArrayInput, cu_seqlens: ArrayInput,
           max_len: Optional[int] = None) -> NDArray[Any]:
    """A packed batch padded: (total, ...) and cu_seqlens (B+1,) -> (B, max_len, ...).

    Sequence b goes to ``x[b, :len_b]``; the rest is zeros. ``max_len`` defaults
    to the longest sequence. The inverse of :func:`attnx.pack`.
    """
    a = as_array(packed, "packed")
    if a.ndim < 1:
        raise ValueError(f"packed must be (total, ...); got shape {shape_str(a)}")
    cu = _cu_seqlens(cu_seqlens, "cu_seqlens", a.shape[0])
    lens = np.diff(cu)
    longest = int(lens.max()) if lens.size else 0
    L = longest if max_len is None else nonnegative_int(max_len, "max_len")
    if L < longest:
        raise ValueError(f"max_len ({L}) is shorter than the longest sequence ({longest})")
    x = np.zeros((lens.size, L) + a.shape[1:], a.dtype)
    for b in range(lens.size):
        x[b, :lens[b]] = a[cu[b]:cu[b + 1]]
    return x
