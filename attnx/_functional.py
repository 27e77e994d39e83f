"""``scaled_dot_product_attention``: the forward pass around the C core.

The arguments are checked by :mod:`attnx._args`; here the plain call takes a
shortcut, the outputs are allocated in the caller's layout, and the batch axes
are folded into the core's (B, H, L, E) views (:func:`_core_calls`). The
arithmetic runs in ``attnx._attnx`` (C).
"""

from __future__ import annotations

import contextvars
import math
from typing import (TYPE_CHECKING, Any, Iterator, List, Literal, NamedTuple, Optional, Tuple, Union,
                    cast, overload)

import numpy as np
from numpy.typing import NDArray

from . import _attnx
# (Alignment, Layout, Precision, Window: names in the signatures that takes() writes)
from ._args import (CAUSAL, F32, Alignment, ArrayInput, AttentionArgs, Causal, Layout, Precision, Window,
                    attention_args, check_flag,
                    default_scale)
from ._options import Options, check_names, names, plain, takes

if TYPE_CHECKING:
    from typing_extensions import Unpack

#: the keywords of scaled_dot_product_attention's **options
OPTIONS = names(Options)

# Threads for the forward calls made in this context (0: the process's count,
# set_num_threads). attnx.torch sets 1 around small calls (see its _threads_for).
CALL_THREADS: contextvars.ContextVar[int] = contextvars.ContextVar("attnx_call_threads", default=0)

__all__ = ["scaled_dot_product_attention"]

_FLOAT32 = np.dtype(np.float32)
#: What scaled_dot_product_attention returns: out, or out with the weights and/or the lse.
_Result = Union[F32, Tuple[F32, F32], Tuple[F32, F32, F32]]


class _CoreCall(NamedTuple):
    """One call of the core: (B, H, L, .) views of the inputs and outputs."""

    q: NDArray[Any]
    k: NDArray[Any]
    v: NDArray[Any]
    mask: Optional[NDArray[Any]]
    key_lengths: Optional[NDArray[np.int64]]
    query_lengths: Optional[NDArray[np.int64]]
    out: NDArray[Any]
    weights: Optional[NDArray[Any]]
    lse: Optional[NDArray[Any]]
    variant: Optional[Tuple[Any, ...]]
    mask_blocks: Optional[NDArray[np.uint8]]

    def core_mask(self) -> Any:
        """The mask as the core takes it: the array, or (array, blocks) for a BlockMask's."""
        return self.mask if self.mask_blocks is None else (self.mask, self.mask_blocks)


def _fold_batch(a: NDArray[Any], nb: int) -> Optional[NDArray[Any]]:
    """A view of ``a`` with its first ``nb`` axes folded into one, or None when
    that needs a copy (e.g. a mask broadcast along one batch axis but not
    another). ``nb = 0`` adds an axis of size 1."""
    if nb == 1:
        return a                          # (B, ...) already: the common 4-D call
    B = math.prod(a.shape[:nb])
    if a.size == 0:
        return a.reshape((B,) + a.shape[nb:])
    axes = [(n, st) for n, st in zip(a.shape[:nb], a.strides[:nb]) if n != 1]
    for (_, st0), (n1, st1) in zip(axes, axes[1:]):
        if st0 != st1 * n1:
            return None
    stride = axes[-1][1] if axes else 0
    return np.lib.stride_tricks.as_strided(a, (B,) + a.shape[nb:], (stride,) + a.strides[nb:],
                                           writeable=a.flags.writeable)


Arrays = List[Optional[NDArray[Any]]]


def fold_calls(batch_shape: Tuple[int, ...], arrays: Arrays,
                lengths: Arrays) -> Iterator[Tuple[Arrays, Arrays]]:
    """Views for the core calls over ``arrays`` (each (batch..., rest) or None)
    and ``lengths`` (each (B, H) with B = prod(batch), or None): one call with
    the batch axes folded into one, or, where folding an array would copy it
    (a broadcast or strided batch axis), one per index of the first batch
    axis, recursively. Nothing is ever expanded or copied."""
    nb = len(batch_shape)
    folded = [None if a is None else _fold_batch(a, nb) for a in arrays]
    if all(f is not None for f, a in zip(folded, arrays) if a is not None):
        yield folded, lengths
        return
    n0 = batch_shape[0]
    for i in range(n0):
        yield from fold_calls(
            batch_shape[1:], [None if a is None else a[i] for a in arrays],
            [None if a is None else a.reshape((n0, -1) + a.shape[1:])[i] for a in lengths])


def _core_calls(p: AttentionArgs, out: NDArray[Any], weights: Optional[NDArray[Any]],
                lse: Optional[NDArray[Any]] = None) -> Iterator[_CoreCall]:
    """The forward's core calls into ``out`` (batch..., Hq, Lq, Ev), ``weights``
    (batch..., Hq, Lq, Lk) and ``lse`` (batch..., Hq, Lq, 1): see fold_calls."""
    for (q, k, v, m, o, w, l4, mb), (kl, ql, slopes, sinks) in fold_calls(
            p.batch_shape, [p.q, p.k, p.v, p.mask, out, weights, lse, p.mask_blocks],
            p.per_head()):
        assert q is not None and k is not None and v is not None and o is not None
        yield _CoreCall(q, k, v, m, kl, ql, o, w, l4, p.variants.core(slopes, sinks), mb)


# The return type follows need_weights and return_lse (a plain bool: any of
# them); the options are declared once, in attnx._options.
@overload
def scaled_dot_product_attention(
        query: ArrayInput, key: ArrayInput, value: ArrayInput, attn_mask: Optional[ArrayInput] = None,
        dropout_p: float = 0.0, is_causal: Causal = False, scale: Optional[float] = None,
        enable_gqa: bool = False, *, need_weights: Literal[False] = False,
        return_lse: Literal[False] = False, **options: Unpack[Options]) -> F32: ...
@overload
def scaled_dot_product_attention(
        query: ArrayInput, key: ArrayInput, value: ArrayInput, attn_mask: Optional[ArrayInput] = None,
        dropout_p: float = 0.0, is_causal: Causal = False, scale: Optional[float] = None,
        enable_gqa: bool = False, *, need_weights: Literal[True],
        return_lse: Literal[False] = False, **options: Unpack[Options]) -> Tuple[F32, F32]: ...
@overload
def scaled_dot_product_attention(
        query: ArrayInput, key: ArrayInput, value: ArrayInput, attn_mask: Optional[ArrayInput] = None,
        dropout_p: float = 0.0, is_causal: Causal = False, scale: Optional[float] = None,
        enable_gqa: bool = False, *, need_weights: Literal[False] = False,
        return_lse: Literal[True], **options: Unpack[Options]) -> Tuple[F32, F32]: ...
@overload
def scaled_dot_product_attention(
        query: ArrayInput, key: ArrayInput, value: ArrayInput, attn_mask: Optional[ArrayInput] = None,
        dropout_p: float = 0.0, is_causal: Causal = False, scale: Optional[float] = None,
        enable_gqa: bool = False, *, need_weights: Literal[True],
        return_lse: Literal[True], **options: Unpack[Options]) -> Tuple[F32, F32, F32]: ...
@overload
def scaled_dot_product_attention(
        query: ArrayInput, key: ArrayInput, value: ArrayInput, attn_mask: Optional[ArrayInput] = None,
        dropout_p: float = 0.0, is_causal: Causal = False, scale: Optional[float] = None,
        enable_gqa: bool = False, *, need_weights: bool = False, return_lse: Literal[False] = False,
        **options: Unpack[Options]) -> Union[F32, Tuple[F32, F32]]: ...
@overload
def scaled_dot_product_attention(
        query: ArrayInput, key: ArrayInput, value: ArrayInput, attn_mask: Optional[ArrayInput] = None,
        dropout_p: float = 0.0, is_causal: Causal = False, scale: Optional[float] = None,
        enable_gqa: bool = False, *, need_weights: bool = False, return_lse: bool = False,
        **options: Unpack[Options]) -> _Result: ...


@takes(Options, before="need_weights")
def scaled_dot_product_attention(
        query: ArrayInput, key: ArrayInput, value: ArrayInput, attn_mask: Optional[ArrayInput] = None,
        dropout_p: float = 0.0, is_causal: Causal = False, scale: Optional[float] = None,
        enable_gqa: bool = False, *, need_weights: bool = False, return_lse: bool = False,
        **options: Unpack[Options]) -> Union[F32, Tuple[F32, F32], Tuple[F32, F32, F32]]:
    """Masked multi-head scaled dot-product attention, ``softmax(Q Kᵀ · scale + mask) V``.

    Names and argument order follow ``torch.nn.functional.scaled_dot_product_attention``,
    so code ports by changing the import. Computed in float32 by the C core.

    Parameters
    ----------
    query : array_like, (B..., Hq, Lq, E)
        With ``layout="blhd"``: (B..., Lq, Hq, E). 2-D (Lq, E) and 3-D (N, Lq, E)
        inputs work as in the tutorials: no head axis is needed.
    key : array_like, (B..., Hk, Lk, E)   (``"blhd"``: (B..., Lk, Hk, E))
    value : array_like, (B..., Hk, Lk, Ev)   (``"blhd"``: (B..., Lk, Hk, Ev))
    attn_mask : array_like, optional
        bool: True = may attend (PyTorch SDPA convention). float: added to the
        scores (use -inf to block). Broadcastable to (B..., Hq, Lq, Lk); a
        broadcast mask is read through strides, never expanded.
    dropout_p : float
        Must be 0.0: attnx computes inference attention.
    is_causal : bool or str
        True or "upper_left": query i sees keys j <= i (PyTorch). "lower_right":
        query i sees keys j <= i + Lk - Lq (the last query sees every key, as
        when decoding with a KV cache). Combined with ``attn_mask`` and the
        lengths by AND.
    scale : float, optional
        Defaults to 1/sqrt(E). Must be finite.
    enable_gqa : bool
        Allow Hq to be a multiple of Hk (grouped-query attention): query head h
        uses key/value head h // (Hq // Hk).
    layout : {"bhld", "blhd"}
        Axis order of query, key, value and the output.
    key_lengths, query_lengths : array_like of int, optional
        Shape (B...) (for 3-D inputs, (N,)). Keys at positions >= key_lengths
        are ignored; query rows at positions >= query_lengths give zeros. This
        is the padding mask without building it.
    window : (int, int), optional
        Sliding window (Mistral, Gemma): query i sees key j only if
        d(i) - left <= j <= d(i) + right, with the diagonal d(i) = i, or
        i + Lk - Lq aligned lower-right (see ``alignment``); -1 or None for an
        unbounded side. Whole tiles outside the band are skipped.
    sinks : array_like, optional
        Attention-sink logits (gpt-oss), shape (Hq,) or broadcastable to
        (B..., Hq): each row's softmax denominator gains exp(sink); the sink
        attends to no value, so the weights of a row sum to less than 1. A row
        with no allowed key still gives zeros.
    softcap : float, optional
        Logit soft-capping (Gemma 2): scores become softcap · tanh(s / softcap),
        s = scale · q·k, before masks and ALiBi are added. Must be > 0.
    alibi_slopes : array_like, optional
        ALiBi (BLOOM, MPT), shape (Hq,) or broadcastable to (B..., Hq): adds
        ``-slope · |d(i) - j|`` to each score, computed in the kernel.
    alignment : {"upper_left", "lower_right"}, optional
        The diagonal d(i) of the window and ALiBi: by default that of
        ``is_causal`` ("lower_right" for is_causal="lower_right"), else
        upper-left; a value that contradicts ``is_causal`` raises ValueError.
    precision : {"highest", "medium"}
        How exact the products Q·Kᵀ and P·V must be. "highest" (the default):
        each exact to float32, the results of every earlier attnx. "medium"
        allows bfloat16 products with float32 accumulation, as torch's
        bfloat16 SDPA and ``torch.set_float32_matmul_precision("medium")``:
        inputs and P rounded to bfloat16 for the products, while the softmax,
        its max and sums and lse stay float32. A permission, not a demand: a
        CPU without bfloat16 dot products computes "medium" as "highest" (the
        same bits); in this version, one with them takes it in the forward
        (decoding's few query rows: from bfloat16, int8 and float16 keys and
        values only) and in four of the backward's five products (S, dP, dV
        and dK; dQ stays float32: see the Precision guide). Against float64,
        "medium"'s error is at most 1.25x that of torch's bfloat16 SDPA on the
        same inputs. Other values raise ValueError.
    need_weights : bool
        Also return the attention weights, (B..., Hq, Lq, Lk), float32.
    return_lse : bool
        Also return ``lse``, (B..., Hq, Lq) float32 (whatever the layout): the
        natural log of each row's softmax denominator, ``log sum_j exp(s_ij)``
        over the row's allowed scaled, masked scores; ``-inf`` for a row with
        no allowed key (and rows past ``query_lengths``). What the backward
        pass and :func:`attnx.merge_attention` take.

    Returns
    -------
    out : ndarray, float32, (B..., Hq, Lq, Ev)   (``"blhd"``: (B..., Lq, Hq, Ev))
    weights : ndarray, float32, (B..., Hq, Lq, Lk); only when ``need_weights``.
    lse : ndarray, float32, (B..., Hq, Lq); only when ``return_lse`` (last).

    A row with no allowed key gives zeros (output and weights), never NaN;
    NaN and inf in the inputs propagate. The inputs are never modified.

    Every array argument may be a NumPy array, a nested sequence, a PyTorch
    CPU tensor (also one that requires grad: it is read through
    ``.detach()``, and no gradient flows back), or any object with
    ``__array__`` or ``__dlpack__``. float32 inputs are read in place, without
    a copy, whenever their last axis is contiguous (a transposed or sliced
    tensor is read through its strides); float16/float64 are converted. The
    result is always a NumPy array.

    Masks from other conventions (True/1 = *blocked*, as in PyTorch tutorials'
    ``scores.masked_fill(mask == 1, -inf)`` or ``torch.nn.MultiheadAttention``;
    0 = blocked, as in NumPy tutorials' ``np.where(mask == 0, -1e9, scores)``): pass
    ``attn_mask=(m == 0)``, ``attn_mask=~m`` or ``attn_mask=(m != 0)``; see
    :func:`attnx.causal_mask` and :func:`attnx.padding_mask` for building them.

    Examples
    --------
    >>> import numpy as np, attnx
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 4, 10, 16), dtype=np.float32) for _ in range(3))
    >>> attnx.scaled_dot_product_attention(q, k, v, is_causal=True).shape
    (2, 4, 10, 16)

    Padding (the second sequence has 6 real keys) with the weights:

    >>> out, w = attnx.scaled_dot_product_attention(q, k, v, key_lengths=[10, 6],
    ...                                             need_weights=True)
    >>> out.shape, w.shape, float(w[1, :, :, 6:].sum())
    ((2, 4, 10, 16), (2, 4, 10, 10), 0.0)

    A bool mask, True = may attend, broadcast over batch and heads:

    >>> mask = attnx.causal_mask(10)                      # (Lq, Lk)
    >>> np.allclose(attnx.scaled_dot_product_attention(q, k, v, attn_mask=mask),
    ...             attnx.scaled_dot_product_attention(q, k, v, is_causal=True))
    True
    """
    need_weights = check_flag(need_weights, "need_weights")
    return_lse = check_flag(return_lse, "return_lse")
    if (attn_mask is None and need_weights is False and return_lse is False
            and enable_gqa is False and (not options or plain(options))):
        out_fast = _fast_path(query, key, value, dropout_p, is_causal, scale)
        if out_fast is not None:
            return out_fast
    check_names(options, OPTIONS, "scaled_dot_product_attention")
    p = attention_args(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                       **options).astype(np.float32, half_kv=True)
    return forward(p, need_weights, return_lse)


def forward(p: AttentionArgs, need_weights: bool, return_lse: bool,
            int8_kv: Optional[Tuple[Any, Any]] = None) -> _Result:
    """The forward of checked arguments (``p`` as ``astype(np.float32,
    half_kv=True)`` gives them): outputs allocated, the core called.
    ``int8_kv``: keys and values of an int8 cache, the core's
    ``((k int8 (B, Hk, Lk, E), k_scale (B, Hk, Lk, 1)), (v..., v_scale...))``,
    read instead of ``p.k`` and ``p.v`` (which then only give the shapes);
    ``p`` must then be 4-D (one core call)."""
    out_shape = p.out_shape
    out = np.empty(p.caller_shape(out_shape), np.float32)
    weights = np.empty(p.scores_shape, np.float32) if need_weights else None
    lse = np.empty(out_shape[:-1], np.float32) if return_lse else None
    out_view, lse_view = p.core_view(out), None if lse is None else lse[..., None]
    if int8_kv is not None and len(p.batch_shape) != 1:
        raise ValueError("int8 keys and values need 4-D arguments")  # (a bug of the caller's)
    for c in _core_calls(p, out_view, weights, lse_view):
        k, v = (c.k, c.v) if int8_kv is None else int8_kv
        _attnx.forward(c.q, k, v, c.out, c.weights, c.core_mask(), c.key_lengths, c.query_lengths,
                       p.causal, p.scale, c.lse, c.variant, CALL_THREADS.get(), p.q_bfloat16)
    if weights is None and lse is None:
        return out
    return cast(_Result, p.results(out, weights, lse))


def _fast_path(q: object, k: object, v: object, dropout_p: object, is_causal: object,
               scale: object) -> Optional[NDArray[np.float32]]:
    """The common call, (B, H, L, E) float32 arrays and no options, computed
    without attention_args (a few microseconds less per call, which is most of
    the overhead of a small problem). What it tests are the conditions of that
    call, not checks: None, for any call that does not meet them, sends it
    through attention_args, which checks everything and words every error."""
    if not (type(q) is np.ndarray and type(k) is np.ndarray and type(v) is np.ndarray):
        return None
    if not (q.dtype == _FLOAT32 and k.dtype == _FLOAT32 and v.dtype == _FLOAT32
            and q.flags.aligned and k.flags.aligned and v.flags.aligned):
        return None
    if not (type(dropout_p) is float and dropout_p == 0.0):
        return None
    return plain_forward(q, k, v, is_causal, scale, False)


def plain_forward(q: NDArray[Any], k: NDArray[Any], v: NDArray[Any], is_causal: object,
                  scale: object, gqa: bool,
                  q_bfloat16: bool = False,
                  threads: Optional[int] = None) -> Optional[NDArray[np.float32]]:
    """The plain call's core forward, on aligned arrays: q float32 (B, Hq, Lq, E)
    (``q_bfloat16``: holding bfloat16 values, see ``AttentionArgs.astype``),
    k and v (B, Hk, Lk, E) and (B, Hk, Lk, Ev), float32, or both float16, or
    both uint16 holding bfloat16 bits, Hk = Hq (or a divisor of it with
    ``gqa``); every last axis contiguous; is_causal a bool; scale None or a
    finite float. Returns the output (B, Hq, Lq, Ev), or None for anything
    else (the caller then takes the checked path). Used by the NumPy fast
    path and by attnx.torch's lean path for the calls models make.
    ``threads``: the call's thread count (None: CALL_THREADS')."""
    if not (q.ndim == 4 and k.ndim == 4 and v.ndim == 4):
        return None
    B, Hq, Lq, E = q.shape
    Hk = k.shape[1]
    if not (k.shape[0] == B and v.shape[:3] == k.shape[:3] and k.shape[3] == E and Hk > 0
            and (Hq == Hk or (gqa and Hq % Hk == 0)) and k.dtype == v.dtype):
        return None
    if not (q.strides[3] == 4 and k.strides[3] == k.itemsize and v.strides[3] == v.itemsize):
        return None
    if not (is_causal is False or is_causal is True):
        return None
    if scale is None:
        scale_f = default_scale(E)
    elif type(scale) is float and math.isfinite(scale):
        scale_f = scale
    else:
        return None
    out = np.empty((B, Hq, Lq, v.shape[3]), dtype=np.float32)
    _attnx.forward(q, k, v, out, None, None, None, None, CAUSAL[is_causal], scale_f, None, None,
                   CALL_THREADS.get() if threads is None else threads, q_bfloat16)
    return out
