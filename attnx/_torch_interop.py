"""Loading a ``torch.nn.MultiheadAttention``'s weights into :class:`attnx.MultiHeadAttention`.

torch computes ``x @ W.T + b`` with ``W`` of shape (out, in); attnx keeps
``W`` as (in, out) for ``x @ W + b``. torch is imported on first use only
(``import attnx`` never imports it), through importlib so that type checkers
do not analyse all of torch for attnx's users.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any, Callable, Optional, Protocol, Tuple, TypeVar

import numpy as np

from ._args import F32


class _Layer(Protocol):
    """What this module reads and writes of an attnx.MultiHeadAttention's
    weights (``_mha_weights.LayerWeights``), named here so that this module
    does not import that one back (it imports this one)."""
    d_model: int
    num_heads: int
    d_head: int
    kdim: int
    vdim: int
    bias: bool
    W_q: F32
    W_k: F32
    W_v: F32
    W_o: F32
    b_q: Optional[F32]
    b_k: Optional[F32]
    b_v: Optional[F32]
    b_o: Optional[F32]

    def _check_parameters(self) -> None: ...


_M = TypeVar("_M", bound=_Layer)


def import_torch() -> Any:
    try:
        torch = importlib.import_module("torch")
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError("loading PyTorch weights needs torch (pip install torch==2.13.0)") from None
    return torch


def _to_numpy(t: Any, transpose: bool = False) -> F32:
    """A float32 NumPy copy of a torch tensor (never sharing memory with it), optionally transposed."""
    torch = import_torch()
    a = t.detach().to(device="cpu", dtype=torch.float32).numpy()
    return np.array(a.T if transpose else a, dtype=np.float32, order="C", copy=True)


def _check_module(module: Any) -> None:
    torch = import_torch()
    if not isinstance(module, torch.nn.MultiheadAttention):
        raise TypeError(f"module must be a torch.nn.MultiheadAttention; got {type(module).__name__}")


def _has_bias(module: Any) -> bool:
    return module.in_proj_bias is not None or module.out_proj.bias is not None


def _check_compatible(layer: _Layer, module: Any) -> None:
    """ValueError unless the module's sizes are the layer's and it has no option attnx lacks."""
    theirs = (module.embed_dim, module.num_heads, module.head_dim, module.kdim, module.vdim)
    ours = (layer.d_model, layer.num_heads, layer.d_head, layer.kdim, layer.vdim)
    if theirs != ours:
        raise ValueError(
            f"the torch module has (embed_dim, num_heads, head_dim, kdim, vdim) = {theirs} but "
            f"{layer!r} has (d_model, num_heads, d_head, kdim, vdim) = {ours}; use "
            f"MultiHeadAttention.from_torch(module) to make a matching layer")
    if module.bias_k is not None or module.bias_v is not None:
        raise ValueError("torch.nn.MultiheadAttention with add_bias_kv=True is not supported")
    if module.add_zero_attn:
        raise ValueError("torch.nn.MultiheadAttention with add_zero_attn=True is not supported")


def _weights(module: Any) -> Tuple[F32, F32, F32, F32]:
    """W_q, W_k, W_v, W_o as attnx's (in, out) float32 arrays."""
    E = module.embed_dim
    if module.in_proj_weight is not None:   # packed (3E, E): rows [q; k; v]
        w = module.in_proj_weight
        wq, wk, wv = w[:E], w[E:2 * E], w[2 * E:]
    else:                                   # separate, when kdim/vdim != E
        wq, wk, wv = module.q_proj_weight, module.k_proj_weight, module.v_proj_weight
    W_q, W_k, W_v = (_to_numpy(t, transpose=True) for t in (wq, wk, wv))
    return W_q, W_k, W_v, _to_numpy(module.out_proj.weight, transpose=True)


def _biases(module: Any) -> Tuple[Optional[F32], Optional[F32], Optional[F32], Optional[F32]]:
    """b_q, b_k, b_v, b_o (zeros for the missing one of in_proj_bias and out_proj.bias),
    or four Nones when the module has no bias."""
    if not _has_bias(module):
        return None, None, None, None
    E = module.embed_dim
    in_b, out_b = module.in_proj_bias, module.out_proj.bias
    b_in = np.zeros(3 * E, np.float32) if in_b is None else _to_numpy(in_b)
    b_q, b_k, b_v = (np.array(b_in[i * E:(i + 1) * E]) for i in range(3))
    b_o = np.zeros(E, np.float32) if out_b is None else _to_numpy(out_b)
    return b_q, b_k, b_v, b_o


def load_torch(layer: _M, module: Any, stacklevel: int) -> _M:
    """:meth:`attnx.MultiHeadAttention.load_torch`; the dropout warning points
    ``stacklevel`` frames up from here (at the caller's call)."""
    _check_module(module)
    dropout = getattr(module, "dropout", 0.0)
    if module.training and isinstance(dropout, (int, float)) and dropout > 0:
        warnings.warn(
            f"the torch.nn.MultiheadAttention is in training mode with dropout={dropout}: attnx "
            f"computes attention without dropout, as the module does in eval mode (call "
            f"module.eval() before comparing results)", UserWarning, stacklevel=stacklevel)
    _check_compatible(layer, module)
    weights, biases = _weights(module), _biases(module)
    # assign only once everything converted
    layer.W_q, layer.W_k, layer.W_v, layer.W_o = weights
    layer.b_q, layer.b_k, layer.b_v, layer.b_o = biases
    layer.bias = _has_bias(module)
    layer._check_parameters()
    return layer


def from_torch(cls: Callable[..., _M], module: Any) -> _M:
    """:meth:`attnx.MultiHeadAttention.from_torch`, which calls it: a dropout
    warning points at that method's caller."""
    _check_module(module)
    layer = cls(module.embed_dim, module.num_heads, module.head_dim, bias=_has_bias(module),
                kdim=module.kdim, vdim=module.vdim, seed=0)
    return load_torch(layer, module, stacklevel=4)
