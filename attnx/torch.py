"""``attnx.torch``: attnx's attention as a differentiable PyTorch function and operator.

``attnx.torch.scaled_dot_product_attention`` is a drop-in for
``torch.nn.functional.scaled_dot_product_attention`` on CPU tensors, with
attnx's extra keywords (``layout``, ``key_lengths``, ``query_lengths``, the
lower-right causal alignment). Gradients flow to query, key, value and a
float ``attn_mask`` tensor through attnx's fused backward pass (``attn_mask``
may also be an :class:`attnx.BlockMask` or a FlexAttention ``BlockMask``,
which get none: they hold no mask tensor).
It is differentiable once: a second derivative (``create_graph=True`` then
another ``grad``: Hessian-vector products, gradient penalties) raises instead
of silently dropping attention's second-order term, and functorch transforms
(``torch.func.vmap``, ``grad``...) are refused by name. torch is imported
here only (``import attnx`` never imports it).

Importing it registers the PyTorch operators ``torch.ops.attnx.scaled_dot_product_attention``
and ``torch.ops.attnx.scaled_dot_product_attention_backward`` (``torch.library.custom_op``,
with fake implementations and autograd: ``attnx._torch_ops``). Under
``torch.compile`` (``fullgraph=True`` too: no graph break) and ``torch.export``
the function calls them, so the graph holds one attnx node for the forward and
one for the backward; in eager mode it runs the same kernels without the
dispatcher's cost per call.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import TYPE_CHECKING, Any, Iterator, Literal, Optional, Tuple, Union, overload

import numpy as np
import torch

# (Alignment, ArrayInput, Precision, Window: names in the signature that takes() writes)
from ._args import (Alignment, ArrayInput, Causal, Layout, Precision, Window, bfloat16_arrays,
                    check_flag, torch_bfloat16)
from ._blockmask import BlockMask
from ._functional import CALL_THREADS, OPTIONS, plain_forward
from . import _functional, _grad
from ._options import DEFAULTS, Options, check_names, plain, takes
from . import _attnx
# the operators (torch.ops.attnx.*), registered on import; they read this module's
# helpers (_numpy, _threads_for, _sdpa...) when called
from . import _torch_ops as _ops
from . import _blockmask
from ._torch_call import call_operator as _call_operator

# every attnx.BlockMask built from now on gets its tensors at once (torch.compile reads them)
_blockmask.ON_BUILD.append(_ops.attach_tensors)

#: the NumPy forward and backward that every call here (and the operators) runs
_sdpa = _functional.scaled_dot_product_attention
_sdpa_backward = _grad.scaled_dot_product_attention_backward

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["scaled_dot_product_attention"]

#: The OpenMP runtime whose threads this module's calls run on (torch's
#: libgomp), or None (attnx's own pool). After each of its ops, torch's OpenMP
#: workers spin for milliseconds; attnx's pool, woken beside them, shared the
#: cores with them: one bfloat16 attention call of a SmolLM-shaped layer
#: right after a torch op took 5.4 ms on 2 threads, 3.1 ms on torch's team
#: (the call alone 2.9; Intel Xeon with AMX, 2 vCPUs). Only the calls made
#: here, in place of torch's own ops, take that team (``_threads_for``);
#: NumPy calls stay on attnx's pool, so that importing this module never
#: starts libgomp's threads where torch had not (a process whose libgomp team
#: ran hangs in its fork children's first parallel region). A fork child of a
#: process with attnx loaded never takes the team. Results are the same bits
#: either way. The runtime under torch's own directory is preferred (another
#: library may have loaded the system's libgomp first).
OPENMP = _attnx.use_openmp(True, os.path.dirname(torch.__file__) + os.sep)


def _forked() -> None:
    """In a fork child the core runs every call on attnx's pool (threads.c):
    say so here too, so that _call_threads keeps the pool's rules."""
    global OPENMP
    OPENMP = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


#: Whether a tensor is a functorch transform's wrapper (vmap, grad, ...).
_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def _check_tensors(tensors: Tuple[Optional[torch.Tensor], ...], names: Tuple[str, ...],
                   functorch: bool = True) -> None:
    """TypeError naming an argument that is not a torch.Tensor (None allowed but
    for query, key, value; an attnx.BlockMask or a FlexAttention BlockMask for
    attn_mask), RuntimeError for tensors of a functorch transform (vmap, grad,
    jacrev, ...: their wrappers have no memory attnx can read; not checked with
    ``functorch=False``, under torch.compile, which handles its transforms)."""
    for t, name in zip(tensors, names):
        if t is None and name not in ("query", "key", "value"):
            continue
        if name == "attn_mask" and (isinstance(t, BlockMask) or _ops.is_flex_block_mask(t)):
            continue
        if not isinstance(t, torch.Tensor):
            also = ("or an attnx.BlockMask; or a FlexAttention BlockMask (create_block_mask); "
                    if name == "attn_mask" else "")
            raise TypeError(f"attnx.torch.scaled_dot_product_attention: {name} must be a "
                            f"torch.Tensor; got {type(t).__name__} ({also}for NumPy arrays use "
                            f"attnx.scaled_dot_product_attention)")
        if functorch and _functorch_wrapped(t):
            raise RuntimeError(f"attnx.torch.scaled_dot_product_attention does not support "
                               f"functorch transforms (torch.func.vmap, grad, jacrev, ...): "
                               f"{name} is a transform's wrapped tensor. Call it outside the "
                               f"transform, or use torch.nn.functional.scaled_dot_product_attention")


#: the tensor types whose memory the eager calls read (other subclasses, a tracer's
#: fake and functional tensors, take the operators)
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _mask_numpy(attn_mask: Union[torch.Tensor, BlockMask, None]) -> Any:
    """``attn_mask`` as the NumPy functions take it: a tensor's memory
    (``_numpy``), an attnx.BlockMask as it is (its map used, not classified
    again), or None."""
    if attn_mask is None or isinstance(attn_mask, BlockMask):
        return attn_mask
    return _numpy(attn_mask, "attn_mask")


def _numpy(t: torch.Tensor, name: str) -> np.ndarray[Any, Any]:
    """A CPU tensor's memory as a NumPy array (float32 computed natively, float16/64
    converted; bfloat16 read through its bits, as ml_dtypes.bfloat16 when installed)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if t.device.type != "cpu":
        raise TypeError(f"{name} must be a CPU tensor (attnx computes on the CPU); got device {t.device}")
    if t.dtype == torch.bfloat16:
        b = torch_bfloat16(t.detach())
        assert b is not None
        return b
    if t.dtype not in (torch.float32, torch.float16, torch.float64, torch.bool):
        raise TypeError(f"{name} must be float32, float16, bfloat16, float64 (or a bool mask); "
                        f"got {t.dtype}")
    a: np.ndarray[Any, Any] = t.detach().resolve_conj().resolve_neg().numpy()
    return a


_LEAN_KV = {torch.float32: None, torch.float16: None, torch.bfloat16: torch.int16}


def _lean(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, is_causal: object,
          scale: object, enable_gqa: object) -> Optional[torch.Tensor]:
    """The calls models make while generating (no mask, no variant, no gradient),
    computed without the general argument handling: most of attnx.torch's own
    cost for a decoding step's attention. Plain tensors (not subclasses, nor a
    functorch transform's) of 4 axes on the CPU, none requiring a gradient: query
    float32 or bfloat16 (converted to float32), key and value float32, float16
    or bfloat16 (read in place, as 16-bit bits). None for anything else, which
    then takes the checked path."""
    wrapped = _functorch_wrapped
    if not (query.is_cpu and key.is_cpu and value.is_cpu
            and not (wrapped(query) or wrapped(key) or wrapped(value))
            and key.dtype == value.dtype and key.dtype in _LEAN_KV
            and query.dtype in (torch.float32, torch.bfloat16)
            and (enable_gqa is False or enable_gqa is True)
            and not (query.is_neg() or key.is_neg() or value.is_neg())):
        return None
    q = query.detach()
    q = (q if q.dtype == torch.float32 else q.float()).numpy()
    bits = _LEAN_KV[key.dtype]
    if bits is None:
        k, v = key.detach().numpy(), value.detach().numpy()
    else:
        k = key.detach().view(bits).numpy().view(np.uint16)
        v = value.detach().view(bits).numpy().view(np.uint16)
    # q's bfloat16 values, as the checked path passes them: only where bfloat16
    # tensors become bfloat16 arrays there (the same bits either way)
    q_bf16 = query.dtype == torch.bfloat16 and bfloat16_arrays()
    with _threads_for(query, key, "bhld"):
        out = plain_forward(q, k, v, is_causal, scale, enable_gqa, q_bf16)
    return None if out is None else torch.from_numpy(out).to(query.dtype)


#: Without torch's team (OPENMP None): a forward of fewer FLOPs (4·B·Hq·Lq·Lk·E)
#: runs on the calling thread inside torch.
SMALL_FLOPS = 8e6
#: So does decoding (at most 4 query rows per key/value head, memory-bound) that
#: reads fewer bytes of keys and values.
SMALL_DECODE_BYTES = 8 << 20


def _call_threads(query: torch.Tensor, key: torch.Tensor, layout: Layout,
                  flops_per_score: float = 4.0) -> int:
    """The thread count for a call inside torch: 1 for a small call when torch
    itself runs on several, else 0 (the process's count).

    On attnx's own pool (OPENMP None), torch's OpenMP workers keep spinning
    for a while after each of its ops, and waking the pool beside them costs
    more than the split saves. Measured on a 2-vCPU AMD EPYC: a decode call (1
    query, 1050 keys, 8 heads, E 64) right after a torch Linear took 215 us on
    2 attnx threads, 85 on one (torch's SDPA 63); a Llama-style model's decode
    step 8.1-8.8 ms against 7.4. Decoding is memory-bound, and one thread
    reads most of the bandwidth two do: in a SmolLM-135M-shaped model at 4096
    tokens (float32, 6.3 MB of keys and values a call, AMD EPYC Zen 5), a call
    took 200-318 us on 2 attnx threads and 242 on one (sdpa 255-272; the
    decoding step 51 ms against sdpa's 55, from 53-55 on 2 threads).

    On torch's team (OPENMP), the spinning workers take the call at once, and
    every call takes the process's count (the core keeps calls under 2 MFLOP
    on one thread itself), or torch's where that is fewer: a call never starts
    more of libgomp's threads than torch's own ops would (with
    ``torch.set_num_threads(1)``, as DataLoader workers do, none: their team
    may be a parent's that did not survive the fork). Measured on an Intel Xeon with AMX (2 vCPUs), right
    after a torch Linear, one query per head, 9 query heads on 3 key/value
    heads, E 64: 1024 keys 115 us (float32; 171 on one thread, sdpa 136),
    4096 keys 234 us (393 on one thread, sdpa 474).
    ``flops_per_score``: per query element and key, 4 for the forward (two
    products), 10 for the backward (five)."""
    if OPENMP is not None:
        torch_threads = torch.get_num_threads()
        return 0 if torch_threads >= _attnx.get_num_threads() else max(torch_threads, 1)
    if torch.get_num_threads() <= 1:
        return 0
    Lk = key.shape[-3] if layout == "blhd" else key.shape[-2]
    flops = flops_per_score * query.numel() * Lk
    q_rows = query.numel() // max(query.shape[-1], 1)           # B·Hq·Lq
    kv_rows = key.numel() // max(key.shape[-1], 1)              # B·Hk·Lk
    decoding = flops_per_score == 4.0 and q_rows * Lk <= 4 * max(kv_rows, 1)
    kv_bytes = 2 * key.numel() * key.element_size()
    small = flops < SMALL_FLOPS or (decoding and kv_bytes < SMALL_DECODE_BYTES)
    return 1 if small else 0


@contextlib.contextmanager
def _threads_for(query: torch.Tensor, key: torch.Tensor, layout: Layout,
                 flops_per_score: float = 4.0) -> Iterator[None]:
    """The calls made in this context take _call_threads' count, on torch's
    OpenMP team where there is one (OPENMP)."""
    token = CALL_THREADS.set(_call_threads(query, key, layout, flops_per_score))
    was = _attnx.on_team(True)
    try:
        yield
    finally:
        _attnx.on_team(was)
        CALL_THREADS.reset(token)


#: what differentiating attnx's gradients again raises
TWICE = ("attnx.torch.scaled_dot_product_attention is differentiable once: the gradients it "
         "returns cannot be differentiated again (create_graph=True then a second grad: "
         "Hessian-vector products, gradient penalties). Use "
         "torch.nn.functional.scaled_dot_product_attention for higher-order derivatives")


def _once_differentiable(grads: Tuple[Optional[torch.Tensor], ...],
                         inputs: Tuple[Optional[torch.Tensor], ...]) -> Tuple[Optional[torch.Tensor], ...]:
    """The gradients under create_graph=True, passed through one graph node
    that raises TWICE when differentiated. The node also takes the forward's
    inputs that require grad, so that it lies on every path from the gradients
    back to them: differentiating a gradient then reaches it and raises.
    (torch's own @once_differentiable adds its node only when the upstream
    gradient requires grad, and only on detached copies: ``(g ** 2).sum()``
    added to a loss would count as a constant, and a Hessian-vector product
    would report the inputs unused.)"""
    live = [i for i, g in enumerate(grads) if g is not None]
    anchors = [t for t in inputs if t is not None and t.requires_grad]
    if not live or not anchors:
        return grads

    def node_input(g: torch.Tensor) -> torch.Tensor:
        g = g.detach()
        g.requires_grad = True
        return g
    err_fn = torch._C._functions.DelayedError(TWICE.encode(), len(live) + len(anchors))
    wrapped = err_fn(*[node_input(g) for g in grads if g is not None], *anchors)
    out = list(grads)
    for i, w in zip(live, wrapped):
        out[i] = w
    return tuple(out)


class _Attention(torch.autograd.Function):  # type: ignore[misc]  # torch is untyped here
    """out = attnx attention(q, k, v, mask); saves out and lse (once each) for the backward.
    An attnx.BlockMask ``attn_mask`` is kept on ctx (not a tensor: no gradient).

    The eager calls on plain tensors that need a gradient, as before the
    operators: the same NumPy forward and backward as the operators' kernels
    (the tests hold the two to the same bits), without the dispatcher, whose
    custom-operator autograd costs more per call than a small attention
    (+50 us and more measured, on a call of 60)."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attn_mask: Union[torch.Tensor, BlockMask, None], sinks: Optional[torch.Tensor],
                opts: dict[str, Any], need_weights: bool) -> Any:
        q, k, v = (_numpy(t, n) for t, n in ((query, "query"), (key, "key"), (value, "value")))
        m = _mask_numpy(attn_mask)
        s = None if sinks is None else _numpy(sinks, "sinks")
        with _threads_for(query, key, opts["layout"]):
            res = _sdpa(q, k, v, attn_mask=m, sinks=s, return_lse=True,
                        need_weights=need_weights, **opts)
        out_t, lse_t = torch.from_numpy(res[0]), torch.from_numpy(res[-1])
        block_mask = isinstance(attn_mask, BlockMask)
        ctx.save_for_backward(query, key, value, None if block_mask else attn_mask, sinks,
                              out_t, lse_t)
        ctx.block_mask = attn_mask if block_mask else None
        ctx.opts = opts
        if not need_weights:
            return out_t.to(query.dtype)
        weights = torch.from_numpy(res[1]).to(query.dtype)
        ctx.mark_non_differentiable(weights)   # a loss of the weights cannot reach the inputs
        return out_t.to(query.dtype), weights

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor, *_: Any) -> Tuple[Optional[torch.Tensor], ...]:
        with torch.no_grad():
            grads = _Attention._gradients(ctx, dout)
        if not torch.is_grad_enabled():          # create_graph=False: the usual case
            return grads
        return _once_differentiable(grads, ctx.saved_tensors[:5])

    @staticmethod
    def _gradients(ctx: Any, dout: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        query, key, value, attn_mask, sinks, out, lse = ctx.saved_tensors
        need = ctx.needs_input_grad            # False for a BlockMask: not a tensor
        with _threads_for(query, key, ctx.opts["layout"], flops_per_score=10.0):
            g = _sdpa_backward(
                _numpy(dout, "grad_output"), _numpy(query, "query"), _numpy(key, "key"),
                _numpy(value, "value"), out.numpy(), lse.numpy(),
                attn_mask=_mask_numpy(ctx.block_mask if attn_mask is None else attn_mask),
                sinks=None if sinks is None else _numpy(sinks, "sinks"),
                mask_grad=bool(need[3]), **ctx.opts)

        def back(a: Optional[np.ndarray[Any, Any]], like: Optional[torch.Tensor],
                 needed: bool) -> Optional[torch.Tensor]:
            if a is None or like is None or not needed:
                return None
            return torch.from_numpy(a).to(like.dtype)

        return (back(g.query, query, need[0]), back(g.key, key, need[1]),
                back(g.value, value, need[2]), back(g.attn_mask, attn_mask, need[3]),
                back(g.sinks, sinks, need[4]), None, None)


# need_weights=False (the default) returns a tensor, True a pair: overloads, so
# that a typed caller's ``out.sum()`` type-checks (a plain bool: either). The
# options are declared once, in attnx._options (``sinks`` must be a tensor here).
@overload
def scaled_dot_product_attention(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        attn_mask: Union[torch.Tensor, BlockMask, None] = None, dropout_p: float = 0.0,
        is_causal: Causal = False, scale: Optional[float] = None, enable_gqa: bool = False, *,
        need_weights: Literal[False] = False, **options: Unpack[Options]) -> torch.Tensor: ...
@overload
def scaled_dot_product_attention(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        attn_mask: Union[torch.Tensor, BlockMask, None] = None, dropout_p: float = 0.0,
        is_causal: Causal = False, scale: Optional[float] = None, enable_gqa: bool = False, *,
        need_weights: Literal[True],
        **options: Unpack[Options]) -> Tuple[torch.Tensor, torch.Tensor]: ...
@overload
def scaled_dot_product_attention(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        attn_mask: Union[torch.Tensor, BlockMask, None] = None, dropout_p: float = 0.0,
        is_causal: Causal = False, scale: Optional[float] = None, enable_gqa: bool = False, *,
        need_weights: bool = False,
        **options: Unpack[Options]) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]: ...


@takes(Options, before="need_weights")
def scaled_dot_product_attention(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        attn_mask: Union[torch.Tensor, BlockMask, None] = None, dropout_p: float = 0.0,
        is_causal: Causal = False, scale: Optional[float] = None, enable_gqa: bool = False, *,
        need_weights: bool = False,
        **options: Unpack[Options]) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """``torch.nn.functional.scaled_dot_product_attention`` computed by attnx, with gradients.

    query (B..., Hq, Lq, E), key (B..., Hk, Lk, E), value (B..., Hk, Lk, Ev):
    CPU tensors (float32 natively; float16, bfloat16 and float64 are computed in
    float32 and the output and gradients come back in the input's dtype). Every argument
    means what it means in :func:`attnx.scaled_dot_product_attention`
    (``attn_mask``, a tensor or an :class:`attnx.BlockMask`: bool, True = may
    attend, or float, added to the scores;
    ``is_causal``: True, "upper_left" or "lower_right"; ``layout="blhd"``
    takes (B, L, H, E); ``key_lengths``/``query_lengths``: padding without a
    mask; ``window``, ``softcap``, ``alibi_slopes``, ``alignment``: the
    attention variants; ``precision``: "highest" or "medium"). Gradients flow to query, key, value, a float
    ``attn_mask`` tensor (summed over its broadcast axes) and ``sinks`` (a tensor of
    sink logits, (Hq,) or broadcastable to (B..., Hq)); ``dropout_p`` must be 0.
    A BlockMask's precomputed map is used in the forward and the backward
    (its mask is not classified again); it holds no tensor, so a float
    BlockMask gets no gradient (query, key and value do): for the mask's
    gradient pass the mask as a float tensor that requires grad.
    ``attn_mask`` may also be a FlexAttention ``BlockMask``
    (``torch.nn.attention.flex_attention.create_block_mask``), made for
    (Q_LEN, KV_LEN) = (Lq, Lk): the mask it stands for as ``flex_attention``'s
    kernel applies it (its ``mask_mod`` in the blocks it lists as partial, every
    key of its full blocks, no key of the blocks it lists in neither; B and H as
    it was made for, broadcast when 1) is evaluated once, at its first use, into
    an :class:`attnx.BlockMask` kept on it, which every later call (layers,
    steps) reuses; one created inside a compiled function is evaluated in the
    graph instead.

    Under ``torch.compile`` and ``torch.export`` the call is the operator
    ``torch.ops.attnx.scaled_dot_product_attention`` (its backward
    ``torch.ops.attnx.scaled_dot_product_attention_backward``): no graph break,
    dynamic sequence lengths; bad arguments raise the same errors, when the
    operator runs.

    Returns the output tensor, (B..., Hq, Lq, Ev) (``"blhd"``: (B..., Lq, Hq, Ev)).
    With ``need_weights=True``, the tuple (output, weights): the attention
    weights (B..., Hq, Lq, Lk), the exact softmax (in the input's dtype), for
    drawing or inspecting; they are not differentiable (gradients flow through
    the output only; a loss of the weights alone raises, as for any tensor
    that does not require grad).

    Example
    -------
    >>> import torch, attnx.torch
    >>> q = torch.randn(2, 4, 10, 16, requires_grad=True)
    >>> out = attnx.torch.scaled_dot_product_attention(q, q, q, is_causal=True)
    >>> out.sum().backward()
    >>> q.grad.shape
    torch.Size([2, 4, 10, 16])
    """
    compiling = torch.compiler.is_compiling()
    if (not compiling and attn_mask is None and need_weights is False
            and (not options or plain(options))
            and type(dropout_p) is float and dropout_p == 0.0
            and type(query) is torch.Tensor and type(key) is torch.Tensor
            and type(value) is torch.Tensor
            and not (torch.is_grad_enabled()
                     and (query.requires_grad or key.requires_grad or value.requires_grad))):
        lean = _lean(query, key, value, is_causal, scale, enable_gqa)
        if lean is not None:
            return lean
    check_names(options, OPTIONS, "scaled_dot_product_attention")
    opts: dict[str, Any] = dict(options, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                                enable_gqa=enable_gqa)
    opts.setdefault("layout", DEFAULTS["layout"])
    sinks = opts.pop("sinks", None)          # a tensor: a gradient flows to it
    layout = opts["layout"]
    tensors = (query, key, value, attn_mask, sinks)
    grad = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                           for t in tensors)
    _check_tensors(tensors, ("query", "key", "value", "attn_mask", "sinks"), not compiling)
    need_weights = check_flag(need_weights, "need_weights")
    # an exported program keeps the lse whatever the grad mode of the export:
    # it may be trained later (the graph holds need_lse as a constant)
    need_lse = grad or torch.compiler.is_exporting()
    if compiling:
        # torch.compile, torch.export: the operators, whose fake implementations
        # give the shapes (functorch transforms are torch.compile's to handle)
        return _call_operator(query, key, value, attn_mask, sinks, opts, need_weights, need_lse)
    if not (type(query) in _PLAIN and type(key) in _PLAIN and type(value) in _PLAIN
            and (type(attn_mask) in _PLAIN or not isinstance(attn_mask, torch.Tensor))
            and (sinks is None or type(sinks) in _PLAIN)):
        # a tracer's tensors (fake, functional: make_fx, AOTAutograd...): the operators
        return _call_operator(query, key, value, attn_mask, sinks, opts, need_weights, need_lse)
    if isinstance(attn_mask, BlockMask):
        _ops.block_mask_tensors(attn_mask)     # for torch.compile later (made once: at its build
                                               # unless that was before `import attnx.torch`)
    elif attn_mask is not None and not isinstance(attn_mask, torch.Tensor):
        _ops.check_flex_lengths(attn_mask, query, key, layout)   # a FlexAttention BlockMask:
        attn_mask = _ops.from_flex(attn_mask)                     # evaluated once, kept on it
    if grad:
        return _Attention.apply(query, key, value, attn_mask, sinks, opts, need_weights)
    # nothing to differentiate (inference, generate()): no lse, no autograd node
    q, k, v = (_numpy(t, n) for t, n in ((query, "query"), (key, "key"), (value, "value")))
    m = _mask_numpy(attn_mask)
    sk = None if sinks is None else _numpy(sinks, "sinks")
    with _threads_for(query, key, layout):
        result = _sdpa(q, k, v, attn_mask=m, sinks=sk, need_weights=need_weights, **opts)
    if need_weights:
        return torch.from_numpy(result[0]).to(query.dtype), torch.from_numpy(result[1]).to(query.dtype)
    return torch.from_numpy(result).to(query.dtype)


_ops.bind(sys.modules[__name__])     # the operators call this module's helpers
