"""Argument conversion and checks shared by every public function of attnx.

* :func:`attention_args` checks the arguments that every attention function
  (forward, reference, gradients) shares, and returns them as
  :class:`AttentionArgs`: (batch..., H, L, E) views the C core or the float64
  reference read after :meth:`AttentionArgs.astype`.
* :func:`output_like` and :func:`lse_like` check a backward pass's ``out``,
  ``dout`` and ``lse`` against them.
* The parts it is built from, each re-exported here (the rest of attnx imports
  them from this module): ``attnx._arrays``, array arguments (any array-like
  as an ndarray, the float and integer checks, bfloat16); ``attnx._scalars``,
  scalar arguments (flags, integers, layout, dropout, is_causal, scale);
  ``attnx._variants``, the variant arguments (window, alignment, softcap,
  ALiBi, sinks, precision).

Every error names the argument at fault and the shapes involved. Nothing here
computes attention; everything is cheap NumPy bookkeeping on views.
"""

from __future__ import annotations

import math
from typing import Any, List, NamedTuple, Optional, Tuple

import numpy as np
from numpy.typing import NDArray

from ._blockmask import split_block_mask
from ._arrays import (ArrayInput, F32, SupportsDLPack, as_array, as_float, astype_broadcast,
                      bfloat16_arrays, bfloat16_view, check_float32_range, check_range,
                      float_array, integer_array, is_bfloat16, is_float_dtype, shape_str,
                      small_float_array, torch_bfloat16, unit_last_stride)
from ._scalars import (CAUSAL, CAUSAL_ARG, Causal, Layout, causal_code, check_dropout, check_flag,
                       check_layout, default_scale, integer, nonnegative_int, positive_int,
                       real_number, scale_value)
from ._variants import (NO_VARIANTS, PRECISION, WINDOW_MAX, Alignment, Precision, Variants, Window,
                        align_code, check_alibi_range, per_head, precision_code, softcap_value,
                        variant_args, window_value)

__all__ = ["align_code", "Alignment", "ArrayInput", "as_array", "as_float",
           "astype_broadcast", "attention_args", "AttentionArgs", "bfloat16_arrays",
           "bfloat16_view", "CAUSAL", "Causal", "CAUSAL_ARG", "causal_code",
           "check_alibi_range", "check_dropout", "check_flag", "check_float32_range",
           "check_layout", "check_range", "default_scale", "F32", "float_array",
           "integer", "integer_array", "is_bfloat16", "is_float_dtype", "Layout",
           "lse_like", "NO_VARIANTS", "nonnegative_int", "output_like", "per_head",
           "positive_int", "PRECISION", "Precision", "precision_code", "real_number",
           "scale_value", "shape_str", "small_float_array", "softcap_value",
           "SupportsDLPack", "torch_bfloat16", "unit_last_stride", "variant_args",
           "Variants", "Window", "WINDOW_MAX", "window_value"]


class AttentionArgs(NamedTuple):
    """The checked arguments of an attention function: views of the inputs
    with every batch axis kept (the core's (B, H, L, E) views come from
    ``attnx._functional._core_calls``), and the scalar arguments as codes."""

    q: NDArray[Any]                         # (batch..., Hq, Lq, E)
    k: NDArray[Any]                         # (batch..., Hk, Lk, E)
    v: NDArray[Any]                         # (batch..., Hk, Lk, Ev)
    mask: Optional[NDArray[Any]]            # (batch..., Hq, Lq, Lk), bool or float, any strides
    key_lengths: Optional[NDArray[np.int64]]    # (B, Hq), B = prod(batch), C-contiguous rows
    query_lengths: Optional[NDArray[np.int64]]  # (B, Hq)
    causal: int                             # CAUSAL_NONE, CAUSAL_UPPER_LEFT or CAUSAL_LOWER_RIGHT
    scale: float
    batch_shape: Tuple[int, ...]
    layout: str
    ndim: int                               # of query as passed (2: a leading axis was added)
    variants: Variants = NO_VARIANTS
    q_bfloat16: bool = False                # q holds bfloat16 values (converted by astype)
    mask_blocks: Optional[NDArray[np.uint8]] = None  # (batch..., Hq, nq, nk): a BlockMask's

    def astype(self, dtype: type[np.floating[Any]], half_kv: bool = False) -> AttentionArgs:
        """q, k, v and a float mask converted to ``dtype`` (float32 for the C
        core, float64 for the reference; no copy where they already are), each
        with a contiguous, aligned last axis; a broadcast mask stays a view.
        ``half_kv``: float16 keys and values stay float16, bfloat16 ones are
        viewed as uint16 (the forward reads either as such, with no float32
        copy; the core takes uint16 as bfloat16 bits). A bfloat16 q sets
        ``q_bfloat16``, which the forward passes on to the core (its values are
        bfloat16: with bfloat16 keys and values the core may use bfloat16 dot
        products)."""
        k, v = self.k, self.v
        if half_kv and k.dtype == v.dtype and is_bfloat16(k.dtype):
            k, v = k.view(np.uint16), v.view(np.uint16)
        elif not (half_kv and k.dtype == v.dtype == np.float16):
            k, v = k.astype(dtype, copy=False), v.astype(dtype, copy=False)
        q = unit_last_stride(self.q.astype(dtype, copy=False))
        k, v = unit_last_stride(k), unit_last_stride(v)
        mask = self.mask
        if mask is not None and mask.dtype != np.bool_ and mask.dtype != dtype:
            mask = astype_broadcast(mask, dtype)
        variants = self.variants.astype(dtype)
        if q is self.q and k is self.k and v is self.v and mask is self.mask \
                and self.variants is NO_VARIANTS:
            return self          # the common case, float32 inputs for the core
        return self._replace(q=q, k=k, v=v, mask=mask, variants=variants,
                             q_bfloat16=self.q_bfloat16 or is_bfloat16(self.q.dtype))

    def per_head(self) -> List[Optional[NDArray[Any]]]:
        """The (B, Hq) arrays of a core call: lengths, ALiBi slopes, sinks."""
        return [self.key_lengths, self.query_lengths, self.variants.alibi, self.variants.sinks]

    @property
    def scores_shape(self) -> Tuple[int, ...]:
        """(batch..., Hq, Lq, Lk): the shape of the weights (and of the mask's view)."""
        return self.batch_shape + self.q.shape[-3:-1] + self.k.shape[-2:-1]

    @property
    def out_shape(self) -> Tuple[int, ...]:
        """(batch..., Hq, Lq, Ev): the output as the core writes it."""
        return self.batch_shape + self.q.shape[-3:-1] + self.v.shape[-1:]

    def caller_shape(self, core: Tuple[int, ...]) -> Tuple[int, ...]:
        """The shape, in the caller's layout, of a (batch..., H, L, X) array."""
        if self.layout == "blhd":
            core = core[:-3] + (core[-2], core[-3], core[-1])
        return core[1:] if self.ndim == 2 else core

    def core_view(self, a: NDArray[Any]) -> NDArray[Any]:
        """The (batch..., H, L, X) view of an array in the caller's layout."""
        if self.layout == "blhd":
            a = np.swapaxes(a, -2, -3)
        return a[None] if self.ndim == 2 else a

    def as_passed(self, a: NDArray[Any]) -> NDArray[Any]:
        """A (batch..., H, Lq, ...) result (weights, lse) without the leading
        axis added to 2-D inputs."""
        return a[0] if self.ndim == 2 else a

    def results(self, out: NDArray[Any], *extras: Optional[NDArray[Any]]) -> Any:
        """``out``, or the tuple of ``out`` and the extras that are not None
        (weights, lse: (batch..., Hq, Lq, ...) arrays, given back without the
        leading axis added to 2-D inputs)."""
        given = [a[0] if self.ndim == 2 else a for a in extras if a is not None]
        return (out, *given) if given else out

    def folded(self) -> Tuple[NDArray[Any], NDArray[Any], NDArray[Any], Optional[NDArray[Any]]]:
        """q, k, v and mask with the batch axes folded into one (copies where a view cannot)."""
        B = math.prod(self.batch_shape)
        q, k, v = (a.reshape((B,) + a.shape[-3:]) for a in (self.q, self.k, self.v))
        m = None if self.mask is None else self.mask.reshape((B,) + self.mask.shape[-3:])
        return q, k, v, m


def attention_args(query: ArrayInput, key: ArrayInput, value: ArrayInput,
                   attn_mask: Optional[ArrayInput] = None, dropout_p: float = 0.0,
                   is_causal: Causal = False, scale: Optional[float] = None,
                   enable_gqa: bool = False, *, layout: Layout = "bhld",
                   key_lengths: Optional[ArrayInput] = None,
                   query_lengths: Optional[ArrayInput] = None, window: Window = None,
                   sinks: Optional[ArrayInput] = None, softcap: Optional[float] = None,
                   alibi_slopes: Optional[ArrayInput] = None,
                   alignment: Alignment = None,
                   precision: Precision = "highest",
                   shown_as: Optional[str] = None) -> AttentionArgs:
    """The arguments every attention function shares (those of
    ``scaled_dot_product_attention`` but its outputs' flags), checked.

    ``shown_as``: how a shape error names the arrays, for callers that check
    views of their own (packed and paged batches check zero-row views, whose
    shapes the caller never passed); default their shapes as given.

    Their names, order and defaults are spelled here once for the code:
    :func:`attnx.reference` passes its arguments on as they came. q, k, v and
    a float mask keep their float dtypes: :meth:`AttentionArgs.astype` gives
    the computation's.
    """
    enable_gqa = check_flag(enable_gqa, "enable_gqa")
    q, k, v, given = _qkv_views(query, key, value, layout)
    heads_are_batch = given[0].ndim == 3 and layout == "bhld"
    _check_shapes(q, k, v, shown_as or "query {}, key {}, value {}".format(
        *(shape_str(a) for a in given)), enable_gqa, heads_are_batch)
    check_dropout(dropout_p)
    causal = causal_code(is_causal)
    Hq, Lq, E = q.shape[-3:]
    Lk = k.shape[-2]
    scale_f = scale_value(scale, E)
    batch_shape = q.shape[:-3]
    given_mask, blocks = split_block_mask(attn_mask)
    mask = None if given_mask is None else _mask_view(given_mask, batch_shape + (Hq, Lq, Lk))
    if blocks is not None:         # its classes of blocks, broadcast as the mask is
        blocks = np.broadcast_to(blocks, batch_shape + (Hq,) + blocks.shape[-2:])

    B = math.prod(batch_shape)
    lead = (Hq,) if heads_are_batch else batch_shape
    kl = ql = None
    if key_lengths is not None:
        kl = _lengths(key_lengths, "key_lengths", lead, Lk, B, Hq, heads_are_batch)
    if query_lengths is not None:
        ql = _lengths(query_lengths, "query_lengths", lead, Lq, B, Hq, heads_are_batch)
    variants = variant_args(window, sinks, softcap, alibi_slopes, alignment, causal,
                            batch_shape + (Hq,), B, Hq, Lq, Lk, precision)
    return AttentionArgs(q, k, v, mask, kl, ql, causal, scale_f, batch_shape, str(layout),
                         given[0].ndim, variants, mask_blocks=blocks)


def _qkv_views(query: object, key: object, value: object, layout: object) -> Tuple[
        NDArray[Any], NDArray[Any], NDArray[Any], Tuple[NDArray[Any], ...]]:
    """The inputs as (lead..., H, L, E) views (blhd swapped, 2-D given a leading
    axis), and the inputs as passed (for messages)."""
    given = (float_array(query, "query"), float_array(key, "key"), float_array(value, "value"))
    q, k, v = given
    check_layout(layout)
    if not (q.ndim == k.ndim == v.ndim):
        raise ValueError(
            f"query, key and value must have the same number of dimensions; got "
            f"query {shape_str(q)}, key {shape_str(k)}, value {shape_str(v)}")
    if q.ndim < 2:
        raise ValueError(f"query, key and value must be at least 2-D (L, E); got query {shape_str(q)}")
    if layout == "blhd":
        if q.ndim < 3:
            raise ValueError(f'layout="blhd" needs (B..., L, H, E) inputs, at least 3-D; got query {shape_str(q)}')
        q, k, v = (np.swapaxes(a, -2, -3) for a in (q, k, v))
    if q.ndim == 2:
        q, k, v = q[None], k[None], v[None]
    return q, k, v, given


def _check_shapes(q: NDArray[Any], k: NDArray[Any], v: NDArray[Any], shapes: str,
                  enable_gqa: bool, three_d: bool) -> None:
    """q (lead..., Hq, Lq, E), k (lead..., Hk, Lk, E), v (lead..., Hk, Lk, Ev)
    agree; an error ends with "; got " and ``shapes``."""
    Hq, E = q.shape[-3], q.shape[-1]
    Hk, Lk, Ek = k.shape[-3:]
    Hv, Lv = v.shape[-3:-1]
    if k.shape[:-3] != q.shape[:-3] or v.shape[:-3] != q.shape[:-3]:
        problem = "query, key and value must have the same batch dimensions"
    elif Ek != E:
        problem = "query and key must have the same last dimension E"
    elif Lv != Lk or Hv != Hk:
        problem = "key and value must have the same heads and length"
    elif Hq != Hk and not enable_gqa:
        problem = (f"query has N={Hq} but key/value have N={Hk}: for 3-D (N, L, E) inputs the "
                   f"first axis N (the batch, or the heads) must match; grouped-query attention "
                   f"(enable_gqa=True) is for 4-D (B, H, L, E) inputs"
                   if three_d else
                   f"query has {Hq} heads but key/value have {Hk}; pass enable_gqa=True for "
                   f"grouped-query attention")
    elif Hq != Hk and (Hk == 0 or Hq % Hk):
        problem = (f"enable_gqa needs query heads ({Hq}) to be a multiple of key/value heads "
                   f"({Hk})")
    else:
        return
    raise ValueError(f"{problem}; got {shapes}")


def _mask_view(attn_mask: object, full: Tuple[int, ...]) -> NDArray[Any]:
    """The mask, bool or float, as a broadcast view of shape ``full`` (never expanded)."""
    m = as_array(attn_mask, "attn_mask")
    if m.dtype != np.bool_ and not is_float_dtype(m.dtype):
        raise TypeError(
            f"attn_mask must be bool (True = attend) or float (added to the scores); got dtype "
            f"{m.dtype} with shape {shape_str(m)}. For a 0/1 integer mask pass mask.astype(bool) "
            f"if 1 means attend, or mask == 0 if 1 means blocked")
    if not m.flags.aligned:      # before broadcasting: never copy an expanded view
        m = m.copy()
    if m.ndim > len(full):
        raise ValueError(f"attn_mask with shape {shape_str(m)} has more dimensions than the scores {full}")
    try:
        return np.broadcast_to(m, full)
    except ValueError:
        raise ValueError(
            f"attn_mask with shape {shape_str(m)} does not broadcast to the "
            f"scores' shape (B..., Hq, Lq, Lk) = {full}") from None


def _lengths(x: object, name: str, lead: Tuple[int, ...], limit: int, B: int, H: int,
             heads_are_batch: bool) -> NDArray[np.int64]:
    """Lengths as an int64 (B, H) array (a broadcast view), checked in [0, limit]."""
    a = integer_array(x, name)
    try:
        a = np.broadcast_to(a, lead)
    except ValueError:
        raise ValueError(
            f"{name} with shape {shape_str(a)} does not broadcast to the batch shape "
            f"{tuple(lead)}") from None
    check_range(a, name, limit)
    flat: NDArray[np.int64] = np.require(a, dtype=np.int64, requirements=["C", "A"]).reshape(-1)
    if heads_are_batch:           # no head axis: one length per leading row
        return flat.reshape(B, H)
    return np.broadcast_to(flat.reshape(B, 1), (B, H))


# ------------------------------------------- arrays shaped like the output

def output_like(x: object, name: str, p: AttentionArgs,
                dtype: type[np.floating[Any]] = np.float32) -> NDArray[Any]:
    """``out`` or ``dout`` of a backward pass: shaped like the forward's output
    in the caller's layout, returned in ``dtype`` as a (batch..., Hq, Lq, Ev) view."""
    a = float_array(x, name)
    want = p.caller_shape(p.out_shape)
    if a.shape != want:
        raise ValueError(f"{name} must have the shape of the attention output {want}; "
                         f"got {shape_str(a)}")
    return unit_last_stride(p.core_view(a.astype(dtype, copy=False)))


def lse_like(x: object, p: AttentionArgs) -> NDArray[np.float32]:
    """``lse`` of a backward pass, (batch..., Hq, Lq), as a float32 (batch..., Hq, Lq, 1) view."""
    a = as_float(x, "lse")
    want = p.out_shape[:-1]
    want = want[1:] if p.ndim == 2 else want
    if a.shape != want:
        raise ValueError(f"lse must have shape (B..., Hq, Lq) = {want}; got {shape_str(a)}")
    a = a[None] if p.ndim == 2 else a
    if not a.flags.aligned:
        a = a.copy()
    return a[..., None]
