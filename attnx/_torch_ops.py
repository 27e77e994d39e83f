"""``torch.ops.attnx``: attnx's attention as PyTorch custom operators.

Two operators, registered with ``torch.library.custom_op`` when
:mod:`attnx.torch` is imported (it calls them, and only it imports this
module):

``torch.ops.attnx.scaled_dot_product_attention`` (the forward) and
``torch.ops.attnx.scaled_dot_product_attention_backward`` (the fused
backward), each with a fake implementation (shapes, dtypes and strides of its
outputs for every option, without computing) and the forward with
``register_autograd``, whose backward calls the backward operator with what
the forward saved: its inputs, ``out`` and ``lse`` (once each). So
``torch.compile(fullgraph=True)`` traces through attention without a graph
break, AOTAutograd traces its backward, and ``torch.export`` records both
operators by name. attnx.torch calls them whenever it is traced (compile,
export, a tracer's fake or functional tensors); its eager calls on plain
tensors run the same NumPy functions without the dispatcher
(``attnx.torch._Attention``), as before the operators existed: the custom
operator's autograd wrapper alone costs more per call than a small attention.

The operators take tensors and plain scalars only (the schemas below):
``attn_mask`` a tensor, with ``mask_blocks``, the uint8 block classes of an
:class:`attnx.BlockMask` (``BlockMask.blocks``), when it is that mask's;
``is_causal`` the core's code (0 none, 1 upper-left, 2 lower-right);
``window`` [left, right] with -1 for an unbounded side. Their outputs are
float32 (attnx.torch converts them to the inputs' dtype outside the
operators, so that the backward reads the float32 output, as the eager
autograd did). Empty tensors (shape (0,)) stand for the outputs not asked
for (weights without ``need_weights``, lse without ``need_lse``, a mask's
gradient without ``mask_grad``, the sinks' without sinks).

Nothing of Python's state is read while tracing: the thread count of a call
is chosen inside the operator, when it runs (as the eager calls always did:
``attnx.torch._call_threads``), so ``torch.set_num_threads`` still applies
to a compiled model. The argument checks are the NumPy functions', run by
the operators: the same exceptions and messages as in eager mode (at run
time under ``torch.compile``: the fake implementations only compute shapes).
"""

from __future__ import annotations

import math
import sys
import types
import warnings
from typing import Any, List, Optional, Sequence, Tuple, cast

import numpy as np
import torch

from ._blockmask import BlockMask
from ._scalars import CAUSAL_ARG, Layout

#: attnx.torch, whose helpers the operators call when they run (a tensor's memory,
#: a call's thread count, the once-differentiable node): handed over by
#: :func:`bind` when attnx.torch is imported. It imports this module, so this
#: one cannot import it (an import circle).
_binding: types.ModuleType


def bind(binding: types.ModuleType) -> None:
    """Called once by attnx.torch, the only importer of this module, with itself."""
    global _binding
    _binding = binding


__all__ = ["bind", "forward", "backward", "mask_tensors", "from_flex", "is_flex_block_mask"]

#: the options every operator takes after its tensors, in the schemas' order
_OPTIONS = ("float dropout_p, int is_causal, float? scale, bool enable_gqa, str layout, "
            "int[]? window, float? softcap, str? alignment, str precision")
_TENSORS = ("Tensor? attn_mask, Tensor? mask_blocks, Tensor? sinks, Tensor? key_lengths, "
            "Tensor? query_lengths, Tensor? alibi_slopes")
_FORWARD_SCHEMA = (f"(Tensor query, Tensor key, Tensor value, {_TENSORS}, {_OPTIONS}, "
                   f"bool need_weights, bool need_lse) -> (Tensor, Tensor, Tensor)")
_BACKWARD_SCHEMA = (f"(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, "
                    f"Tensor lse, {_TENSORS}, {_OPTIONS}, bool mask_grad) "
                    f"-> (Tensor, Tensor, Tensor, Tensor, Tensor)")

_F32 = torch.float32


def _options(dropout_p: float, is_causal: int, scale: Optional[float], enable_gqa: bool,
             layout: str, window: Optional[Sequence[int]], softcap: Optional[float],
             alignment: Optional[str], precision: str, key_lengths: Optional[torch.Tensor],
             query_lengths: Optional[torch.Tensor],
             alibi_slopes: Optional[torch.Tensor]) -> dict[str, Any]:
    """The keywords of attnx's NumPy functions for an operator's arguments."""
    opts: dict[str, Any] = dict(dropout_p=dropout_p, is_causal=CAUSAL_ARG.get(is_causal, is_causal),
                                scale=scale, enable_gqa=enable_gqa, layout=layout,
                                precision=precision)
    if window is not None:
        opts["window"] = tuple(window)
    if softcap is not None:
        opts["softcap"] = softcap
    if alignment is not None:
        opts["alignment"] = alignment
    for name, t in (("key_lengths", key_lengths), ("query_lengths", query_lengths),
                    ("alibi_slopes", alibi_slopes)):
        if t is not None:
            opts[name] = t.detach().cpu().numpy()
    return opts


def _mask_arg(attn_mask: Optional[torch.Tensor], mask_blocks: Optional[torch.Tensor]) -> Any:
    """The mask as the NumPy functions take it: None, an array, or an
    attnx.BlockMask of the mask and its classes (as attnx.BlockMask(mask) built
    them: they are not classified again)."""
    if attn_mask is None:
        return None
    m = _binding._numpy(attn_mask, "attn_mask")
    if mask_blocks is None:
        return m
    if mask_blocks.dtype != torch.uint8:
        raise TypeError(f"mask_blocks must be uint8 (attnx.BlockMask.blocks); got {mask_blocks.dtype}")
    bm = BlockMask.__new__(BlockMask)
    bm._mask = m
    bm._blocks = mask_blocks.numpy()
    return bm


def _tensor(a: Optional[np.ndarray[Any, Any]]) -> torch.Tensor:
    """An array computed here as a tensor (float32, C-contiguous: what the fake
    implementations say), or an empty one for None."""
    if a is None:
        return torch.empty(0, dtype=_F32)
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))


# ---- the forward ---------------------------------------------------------------------------

def _forward_impl(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attn_mask: Optional[torch.Tensor], mask_blocks: Optional[torch.Tensor],
                  sinks: Optional[torch.Tensor], key_lengths: Optional[torch.Tensor],
                  query_lengths: Optional[torch.Tensor], alibi_slopes: Optional[torch.Tensor],
                  dropout_p: float, is_causal: int, scale: Optional[float], enable_gqa: bool,
                  layout: str, window: Optional[List[int]], softcap: Optional[float],
                  alignment: Optional[str], precision: str, need_weights: bool,
                  need_lse: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, lse, weights), float32: out (B..., Hq, Lq, Ev) ("blhd": (B..., Lq,
    Hq, Ev)); lse (B..., Hq, Lq) with ``need_lse``; weights (B..., Hq, Lq, Lk)
    with ``need_weights``; (0,) for those not asked for."""
    q, k, v = (_binding._numpy(t, n) for t, n in ((query, "query"), (key, "key"), (value, "value")))
    opts = _options(dropout_p, is_causal, scale, enable_gqa, layout, window, softcap, alignment,
                    precision, key_lengths, query_lengths, alibi_slopes)
    s = None if sinks is None else _binding._numpy(sinks, "sinks")
    with _binding._threads_for(query, key, cast(Layout, layout)):
        res = _binding._sdpa(q, k, v, attn_mask=_mask_arg(attn_mask, mask_blocks), sinks=s,
                             need_weights=need_weights, return_lse=need_lse, **opts)
    if not (need_weights or need_lse):
        return _tensor(cast(Any, res)), _tensor(None), _tensor(None)
    res = cast(Tuple[Any, ...], res)
    return (_tensor(res[0]), _tensor(res[-1] if need_lse else None),
            _tensor(res[1] if need_weights else None))


def _heads_rows(query: torch.Tensor, key: torch.Tensor, layout: str) -> Tuple[Any, Any]:
    """(rows, Lk): rows = (B..., Hq, Lq), the shape of lse, whatever the layout."""
    if layout == "blhd" and query.dim() >= 3:
        return (*query.shape[:-3], query.shape[-2], query.shape[-3]), key.shape[-3]
    return tuple(query.shape[:-1]), key.shape[-2]


def _forward_fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attn_mask: Optional[torch.Tensor], mask_blocks: Optional[torch.Tensor],
                  sinks: Optional[torch.Tensor], key_lengths: Optional[torch.Tensor],
                  query_lengths: Optional[torch.Tensor], alibi_slopes: Optional[torch.Tensor],
                  dropout_p: float, is_causal: int, scale: Optional[float], enable_gqa: bool,
                  layout: str, window: Optional[List[int]], softcap: Optional[float],
                  alignment: Optional[str], precision: str, need_weights: bool,
                  need_lse: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch._check(query.dim() >= 2 and query.dim() == key.dim() == value.dim(),
                 lambda: f"query, key and value must have the same number of dimensions, at "
                         f"least 2; got query {tuple(query.shape)}, key {tuple(key.shape)}, "
                         f"value {tuple(value.shape)}")
    rows, Lk = _heads_rows(query, key, layout)
    out = query.new_empty((*query.shape[:-1], value.shape[-1]), dtype=_F32)
    lse = query.new_empty(rows if need_lse else (0,), dtype=_F32)
    weights = query.new_empty((*rows, Lk) if need_weights else (0,), dtype=_F32)
    return out, lse, weights


# ---- the backward --------------------------------------------------------------------------

def _backward_impl(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   attn_mask: Optional[torch.Tensor], mask_blocks: Optional[torch.Tensor],
                   sinks: Optional[torch.Tensor], key_lengths: Optional[torch.Tensor],
                   query_lengths: Optional[torch.Tensor], alibi_slopes: Optional[torch.Tensor],
                   dropout_p: float, is_causal: int, scale: Optional[float], enable_gqa: bool,
                   layout: str, window: Optional[List[int]], softcap: Optional[float],
                   alignment: Optional[str], precision: str,
                   mask_grad: bool) -> Tuple[torch.Tensor, ...]:
    """(d query, d key, d value, d attn_mask, d sinks), float32, each shaped like
    its input (the mask's with ``mask_grad`` and a float mask, the sinks' with
    sinks; else (0,)): attnx's fused backward from the forward's out and lse."""
    opts = _options(dropout_p, is_causal, scale, enable_gqa, layout, window, softcap, alignment,
                    precision, key_lengths, query_lengths, alibi_slopes)
    with _binding._threads_for(query, key, cast(Layout, layout), flops_per_score=10.0):
        g = _binding._sdpa_backward(
            _binding._numpy(grad_out, "grad_output"), _binding._numpy(query, "query"),
            _binding._numpy(key, "key"), _binding._numpy(value, "value"),
            _binding._numpy(out, "out"), _binding._numpy(lse, "lse"),
            attn_mask=_mask_arg(attn_mask, mask_blocks),
            sinks=None if sinks is None else _binding._numpy(sinks, "sinks"),
            mask_grad=mask_grad, **opts)
    return (_tensor(g.query), _tensor(g.key), _tensor(g.value),
            _tensor(g.attn_mask if mask_grad else None), _tensor(g.sinks))


def _backward_fake(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   attn_mask: Optional[torch.Tensor], mask_blocks: Optional[torch.Tensor],
                   sinks: Optional[torch.Tensor], key_lengths: Optional[torch.Tensor],
                   query_lengths: Optional[torch.Tensor], alibi_slopes: Optional[torch.Tensor],
                   dropout_p: float, is_causal: int, scale: Optional[float], enable_gqa: bool,
                   layout: str, window: Optional[List[int]], softcap: Optional[float],
                   alignment: Optional[str], precision: str,
                   mask_grad: bool) -> Tuple[torch.Tensor, ...]:
    def like(t: Optional[torch.Tensor], wanted: bool = True) -> torch.Tensor:
        if t is None or not wanted:
            return query.new_empty((0,), dtype=_F32)
        return query.new_empty(t.shape, dtype=_F32)
    float_mask = attn_mask is not None and attn_mask.dtype != torch.bool
    return (like(query), like(key), like(value), like(attn_mask, mask_grad and float_mask),
            like(sinks))


# ---- autograd ------------------------------------------------------------------------------

#: the forward operator's tensor inputs, in order; then come its options (_N_OPTIONS) and
#: need_weights, need_lse
_INPUTS = ("query", "key", "value", "attn_mask", "mask_blocks", "sinks", "key_lengths",
           "query_lengths", "alibi_slopes")
_N_OPTIONS = 9


def _gradients(ctx: Any, grad_out: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
    """The gradients of the forward's tensor inputs (_INPUTS), in their dtypes,
    None where not needed: the backward operator (in eager mode its kernel,
    called directly) on what _setup_context kept."""
    saved = ctx.saved_tensors
    query, key, value, attn_mask, mask_blocks, sinks = saved[:6]
    out, lse = saved[-2:]
    if lse.dim() == 1 and lse.shape[0] == 0 and out.numel() != 0:
        raise RuntimeError("torch.ops.attnx.scaled_dot_product_attention was called with "
                           "need_lse=False: its backward needs the lse")
    need = ctx.needs_input_grad
    eager = type(grad_out) is torch.Tensor and not torch.compiler.is_compiling()
    run: Any = _backward_impl if eager else backward     # eager: without the dispatcher
    g = run(
        grad_out, query, key, value, out, lse, *saved[3:9], *ctx.options, bool(need[3]))

    def back(i: int, like: Optional[torch.Tensor], needed: bool) -> Optional[torch.Tensor]:
        return None if like is None or not needed else g[i].to(like.dtype)

    grads: Tuple[Optional[torch.Tensor], ...] = (
        back(0, query, need[0]), back(1, key, need[1]), back(2, value, need[2]),
        back(3, attn_mask, need[3]), None, back(4, sinks, need[5]), None, None, None)
    if eager and torch.is_grad_enabled():          # create_graph=True
        grads = _binding._once_differentiable(grads, (query, key, value, attn_mask, sinks))
    return grads


def _setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Tuple[torch.Tensor, ...]) -> None:
    """What the backward reads: the tensor inputs, out and lse (each once), the options."""
    n = len(_INPUTS)
    out, lse, weights = output
    ctx.save_for_backward(*inputs[:n], out, lse)
    ctx.options = inputs[n:n + _N_OPTIONS]
    ctx.mark_non_differentiable(lse, weights)   # the weights: for drawing, not differentiable


def _backward(ctx: Any, grad_out: torch.Tensor, *_: Any) -> Tuple[Optional[torch.Tensor], ...]:
    return _gradients(ctx, grad_out) + (None,) * (_N_OPTIONS + 2)


# registered without decorators (torch's are untyped for mypy)
_forward_op: Any = torch.library.custom_op("attnx::scaled_dot_product_attention", _forward_impl,
                                           mutates_args=(), schema=_FORWARD_SCHEMA)
_forward_op.register_fake(_forward_fake)
_forward_op.register_autograd(_backward, setup_context=_setup_context)
_backward_op: Any = torch.library.custom_op("attnx::scaled_dot_product_attention_backward",
                                            _backward_impl, mutates_args=(),
                                            schema=_BACKWARD_SCHEMA)
_backward_op.register_fake(_backward_fake)


def _no_setup(ctx: Any, inputs: Tuple[Any, ...], output: Tuple[torch.Tensor, ...]) -> None:
    pass


def _twice(ctx: Any, *grads: Any) -> Tuple[Optional[torch.Tensor], ...]:
    raise RuntimeError(_binding.TWICE)


# differentiable once: differentiating the backward raises what attnx.torch's eager path raises
_backward_op.register_autograd(_twice, setup_context=_no_setup)

#: the operators (OpOverloads: called without the CustomOpDef's Python wrapper)
forward = torch.ops.attnx.scaled_dot_product_attention.default
backward = torch.ops.attnx.scaled_dot_product_attention_backward.default


# ---- masks as the operators take them ------------------------------------------------------

def _readonly_tensor(a: np.ndarray[Any, Any]) -> torch.Tensor:
    """A tensor of a read-only array's memory (a BlockMask's: never written)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)     # "the NumPy array is not writable"
        return torch.from_numpy(a)


def block_mask_tensors(bm: BlockMask) -> Tuple[torch.Tensor, torch.Tensor]:
    """An attnx.BlockMask's mask and block classes as tensors sharing its memory,
    made once and kept on it (``_torch``): when it is built, once attnx.torch is
    imported (_blockmask.ON_BUILD), else at its first use here outside
    torch.compile (which cannot read its sealed arrays; torch.export's
    non-strict tracing reads the tensors kept here)."""
    cached = getattr(bm, "_torch", None)
    if cached is None:
        if torch.compiler.is_compiling():
            raise TypeError(
                "attnx.BlockMask under torch.compile: this BlockMask was built before "
                "attnx.torch was imported and never used by it, so it has no tensors to be read "
                "in a graph. Build it after `import attnx.torch`, or call "
                "attnx.torch.scaled_dot_product_attention with it once outside torch.compile")
        cached = attach_tensors(bm)
    return cached


def attach_tensors(bm: BlockMask) -> Tuple[torch.Tensor, torch.Tensor]:
    """Makes and keeps an attnx.BlockMask's tensors (``_torch``): the hook
    attnx.torch registers for every BlockMask built (_blockmask.ON_BUILD). It
    never raises: a BlockMask built while another thread compiles, or inside
    an exported forward, is a NumPy object like any other."""
    cached = getattr(bm, "_torch", None)
    if cached is None:
        cached = (_readonly_tensor(bm.mask), _readonly_tensor(bm.blocks))
        bm._torch = cached    # type: ignore[attr-defined]
    return cached


def is_flex_block_mask(x: object) -> bool:
    """Whether ``x`` is a FlexAttention BlockMask (torch.nn.attention.flex_attention,
    not imported here: without it loaded, nothing can be one)."""
    flex = sys.modules.get("torch.nn.attention.flex_attention")
    return flex is not None and isinstance(x, flex.BlockMask)


def _block_rows(num: torch.Tensor, idx: torch.Tensor, nk: int) -> torch.Tensor:
    """A FlexAttention block list (``kv_num_blocks`` (..., nq), ``kv_indices``
    (..., nq, m)) as a dense bool (..., nq, nk): True for the listed blocks."""
    valid = torch.arange(idx.shape[-1], device=idx.device) < num.unsqueeze(-1)
    cols = torch.where(valid, idx.long(), nk)
    dense = torch.zeros((*idx.shape[:-1], nk + 1), dtype=torch.bool, device=idx.device)
    return dense.scatter(-1, cols, True)[..., :nk]


def flex_dense(block_mask: Any) -> Optional[torch.Tensor]:
    """The bool mask (B, H, Q_LEN, KV_LEN) (B and H those the BlockMask was made
    for: 1 where it broadcasts) that a FlexAttention BlockMask stands for, as
    ``flex_attention`` applies it: its ``mask_mod`` in the partial blocks, True
    in the full blocks, False in the blocks it lists in neither. None for the
    "no mask" BlockMask flex_attention makes itself (every key allowed)."""
    flex = sys.modules["torch.nn.attention.flex_attention"]
    rq, rk = block_mask.BLOCK_SIZE
    if rq == rk == flex._LARGE_SPARSE_BLOCK_SIZE:
        return None
    Lq, Lk = block_mask.seq_lengths
    num, idx = block_mask.kv_num_blocks, block_mask.kv_indices
    nk = -(-Lk // rk)
    lead = tuple(num.shape[:-1])

    def rows(blocks: torch.Tensor) -> torch.Tensor:    # (..., nq, nk) -> (..., Lq, Lk)
        return blocks.repeat_interleave(rq, -2)[..., :Lq, :].repeat_interleave(rk, -1)[..., :Lk]

    dense = rows(_block_rows(num, idx, nk))
    if block_mask.mask_mod is not flex.noop_mask:
        B, H = (lead + (1, 1))[:2] if len(lead) <= 2 else (math.prod(lead[:-1]), lead[-1])
        mm = flex.create_mask(block_mask.mask_mod, B, H, Lq, Lk, device=idx.device)
        dense = dense & mm.reshape(*lead, Lq, Lk).to(torch.bool)
    if block_mask.full_kv_num_blocks is not None:
        dense = dense | rows(_block_rows(block_mask.full_kv_num_blocks,
                                         block_mask.full_kv_indices, nk))
    return dense


def from_flex(block_mask: Any) -> Optional[BlockMask]:
    """A FlexAttention BlockMask as an attnx.BlockMask (its mask evaluated once,
    then classified), made once and kept on it (``_attnx_mask``, a 1-tuple);
    None for a mask that allows every key."""
    cached = flex_cached(block_mask)
    if cached is None:
        if not _plain_flex(block_mask):
            raise TypeError("attn_mask: a FlexAttention BlockMask whose tensors are a tracer's "
                            "(fake or functional tensors) cannot be evaluated outside the trace")
        dense = flex_dense(block_mask)
        cached = (None if dense is None else BlockMask(dense.detach().cpu().numpy()),)
        block_mask._attnx_mask = (_flex_key(block_mask), cached)
    bm: Optional[BlockMask] = cached[0]
    return bm


def _flex_key(block_mask: Any) -> Tuple[Any, ...]:
    """What a FlexAttention BlockMask's mask is made of: its mask_mod, lengths,
    block size, and each of its tensors by identity and version (FlexAttention's
    decoding loops change them in place)."""
    return tuple((id(x), x._version) if isinstance(x, torch.Tensor) else x
                 for x in block_mask.as_tuple())


def flex_cached(block_mask: Any) -> Optional[Tuple[Optional[BlockMask]]]:
    """The attnx.BlockMask kept on a FlexAttention BlockMask (a 1-tuple), or None
    when there is none or the mask changed since it was made."""
    kept = getattr(block_mask, "_attnx_mask", None)
    if kept is None or not _plain_flex(block_mask) or kept[0] != _flex_key(block_mask):
        return None
    cached: Tuple[Optional[BlockMask]] = kept[1]
    return cached


def _plain_flex(block_mask: Any) -> bool:
    """Whether a FlexAttention BlockMask's tensors are plain tensors (not a tracer's)."""
    return all(type(x) is torch.Tensor for x in block_mask.as_tuple()
               if isinstance(x, torch.Tensor))


def check_flex_lengths(block_mask: Any, query: torch.Tensor, key: torch.Tensor,
                       layout: str) -> None:
    """ValueError unless a FlexAttention BlockMask was made for these lengths."""
    rows, Lk = _heads_rows(query, key, layout)
    Lq = rows[-1]
    if tuple(block_mask.seq_lengths) != (Lq, Lk):
        raise ValueError(
            f"attn_mask: the FlexAttention BlockMask was created for (Q_LEN, KV_LEN) = "
            f"{tuple(block_mask.seq_lengths)} but query has Lq={Lq} and key Lk={Lk} (query "
            f"{tuple(query.shape)}, key {tuple(key.shape)}); create it for these lengths")


def mask_tensors(attn_mask: Any, query: torch.Tensor, key: torch.Tensor,
                 layout: str) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``attn_mask`` as the operators take it: (mask, block classes or None).
    A FlexAttention BlockMask is evaluated once into an attnx.BlockMask (kept
    on it); while compiling, a BlockMask that was never evaluated (created in
    the compiled code) is evaluated in the graph, and its mask then classified
    by the core at each call (as any mask is)."""
    if attn_mask is None or isinstance(attn_mask, torch.Tensor):
        return attn_mask, None
    if isinstance(attn_mask, BlockMask):
        return block_mask_tensors(attn_mask)
    check_flex_lengths(attn_mask, query, key, layout)
    traced = (torch.compiler.is_compiling() or type(query) is not torch.Tensor
              or type(key) is not torch.Tensor)
    kept = flex_cached(attn_mask)
    if kept is None and (traced or not _plain_flex(attn_mask)):
        return flex_dense(attn_mask), None     # evaluated in the trace, not kept
    bm = kept[0] if kept is not None else from_flex(attn_mask)
    return (None, None) if bm is None else block_mask_tensors(bm)
