"""The weights of :class:`attnx.MultiHeadAttention`: its sizes, the four
projections' arrays (initialised, checked, listed) and torch's weights loaded
into them. The layer's call and vjp are in :mod:`attnx._mha`, the projections'
arithmetic in :mod:`attnx._mha_projections`.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, SupportsIndex, TypeVar, Union

import numpy as np
from numpy.typing import NDArray

from . import _torch_interop
from ._args import F32, check_flag, positive_int, shape_str

_M = TypeVar("_M", bound="LayerWeights")


def _xavier(rng: np.random.Generator, fan_in: int, fan_out: int) -> F32:
    """Xavier/Glorot uniform: U(-a, a), a = sqrt(6 / (fan_in + fan_out)); (fan_in, fan_out) float32."""
    a = np.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-a, a, size=(fan_in, fan_out)).astype(np.float32)


class LayerWeights:
    """The sizes and weights of a multi-head attention layer (documented on
    :class:`attnx.MultiHeadAttention`, which is one).

    >>> import attnx
    >>> layer = attnx.MultiHeadAttention(8, 2, bias=False)
    >>> layer.inner_dim, sorted(layer.parameters())
    (8, ['W_k', 'W_o', 'W_q', 'W_v'])
    """

    d_model: int
    num_heads: int
    d_head: int
    kdim: int
    vdim: int
    bias: bool
    W_q: NDArray[np.float32]
    W_k: NDArray[np.float32]
    W_v: NDArray[np.float32]
    W_o: NDArray[np.float32]
    b_q: Optional[NDArray[np.float32]]
    b_k: Optional[NDArray[np.float32]]
    b_v: Optional[NDArray[np.float32]]
    b_o: Optional[NDArray[np.float32]]

    def __init__(self, d_model: SupportsIndex, num_heads: SupportsIndex,
                 d_head: Optional[SupportsIndex] = None, *, bias: bool = True,
                 kdim: Optional[SupportsIndex] = None, vdim: Optional[SupportsIndex] = None,
                 seed: Union[None, int, np.random.SeedSequence, np.random.Generator] = None,
                 ) -> None:
        dm = positive_int(d_model, "d_model")
        H = positive_int(num_heads, "num_heads")
        dh = max(1, dm // H) if d_head is None else positive_int(d_head, "d_head")
        kd = dm if kdim is None else positive_int(kdim, "kdim")
        vd = dm if vdim is None else positive_int(vdim, "vdim")

        self.d_model = dm
        self.num_heads = H
        self.d_head = dh
        self.kdim = kd
        self.vdim = vd
        self.bias = check_flag(bias, "bias")

        HD = H * dh
        rng = np.random.default_rng(seed)
        self.W_q = _xavier(rng, dm, HD)
        self.W_k = _xavier(rng, kd, HD)
        self.W_v = _xavier(rng, vd, HD)
        self.W_o = _xavier(rng, HD, dm)
        if self.bias:
            self.b_q = np.zeros(HD, dtype=np.float32)
            self.b_k = np.zeros(HD, dtype=np.float32)
            self.b_v = np.zeros(HD, dtype=np.float32)
            self.b_o = np.zeros(dm, dtype=np.float32)
        else:
            self.b_q = self.b_k = self.b_v = self.b_o = None

    @property
    def inner_dim(self) -> int:
        """H * d_head: the width of the concatenated heads."""
        return self.num_heads * self.d_head

    def _check_parameters(self) -> None:
        HD = self.inner_dim
        expected = {
            "W_q": (self.d_model, HD), "W_k": (self.kdim, HD), "W_v": (self.vdim, HD),
            "W_o": (HD, self.d_model),
            "b_q": (HD,), "b_k": (HD,), "b_v": (HD,), "b_o": (self.d_model,),
        }
        for name, shape in expected.items():
            w = getattr(self, name)
            if w is None and name.startswith("b_"):
                continue
            if not isinstance(w, np.ndarray) or w.shape != shape:
                got = shape_str(w) if isinstance(w, np.ndarray) else type(w).__name__
                raise ValueError(f"{self!r}: {name} must be an array of shape {shape}; got {got}")

    def __repr__(self) -> str:
        extra = ""
        if self.kdim != self.d_model:
            extra += f", kdim={self.kdim}"
        if self.vdim != self.d_model:
            extra += f", vdim={self.vdim}"
        return (f"{type(self).__name__}(d_model={self.d_model}, num_heads={self.num_heads}, "
                f"d_head={self.d_head}, bias={self.bias}{extra})")

    def parameters(self) -> Dict[str, NDArray[np.float32]]:
        """The layer's arrays by name (W_q, W_k, W_v, W_o, and b_q, b_k, b_v, b_o
        when it has biases): the live arrays, so an optimiser updates them in place
        (``p -= lr * grads[name]``)."""
        names = ("W_q", "W_k", "W_v", "W_o", "b_q", "b_k", "b_v", "b_o")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def load_torch(self: _M, module: Any) -> _M:
        """Copy the weights of a ``torch.nn.MultiheadAttention`` into this layer (in place).

        torch computes ``x @ W.T + b`` with ``W`` of shape (out, in): its packed
        ``in_proj_weight`` (3E, E) holds the query, key and value rows (or
        ``q_proj_weight`` (E, E), ``k_proj_weight`` (E, kdim), ``v_proj_weight``
        (E, vdim) when kdim/vdim differ from E), ``in_proj_bias`` (3E,), and
        ``out_proj`` a Linear(E, E). They are copied as float32 NumPy arrays
        (``W_q = in_proj_weight[:E].T`` and so on), sharing no memory with
        torch. The layer then gives torch's results (with the mask conventions
        described in the class docstring); ``batch_first`` does not matter.

        The layer's d_model, num_heads, d_head, kdim and vdim must match the
        module's (embed_dim, num_heads, head_dim = embed_dim // num_heads,
        kdim, vdim); the biases follow the module's (``self.bias`` is updated).
        Modules with ``add_bias_kv`` or ``add_zero_attn`` are refused. Dropout
        is not applied (put the torch module in ``eval()`` mode to compare): a
        module in training mode with ``dropout > 0`` gives a UserWarning.

        Returns ``self``.

        Examples
        --------
        >>> import torch, attnx                                    # doctest: +SKIP
        >>> t = torch.nn.MultiheadAttention(64, 8, batch_first=True).eval()  # doctest: +SKIP
        >>> mha = attnx.MultiHeadAttention(64, 8).load_torch(t)    # doctest: +SKIP
        """
        return _torch_interop.load_torch(self, module, stacklevel=3)

    @classmethod
    def from_torch(cls: type[_M], module: Any) -> _M:
        """A new layer holding a copy of a ``torch.nn.MultiheadAttention``'s weights.

        Sizes (embed_dim, num_heads, kdim, vdim) and biases are taken from the
        module; see :meth:`load_torch` (a module in training mode with
        ``dropout > 0`` gives a UserWarning: attnx applies no dropout). torch needs ``embed_dim`` divisible by
        ``num_heads``, so the layer has ``d_head = embed_dim // num_heads``.

        Examples
        --------
        >>> import numpy as np, torch, attnx                                  # doctest: +SKIP
        >>> t = torch.nn.MultiheadAttention(64, 8, batch_first=True).eval()   # doctest: +SKIP
        >>> mha = attnx.MultiHeadAttention.from_torch(t)                      # doctest: +SKIP
        >>> x = np.random.default_rng(0).standard_normal((2, 5, 64), dtype=np.float32)  # doctest: +SKIP
        >>> ref = t(*(torch.from_numpy(x),) * 3, need_weights=False)[0].detach().numpy()  # doctest: +SKIP
        >>> np.allclose(mha(x), ref, atol=1e-5)                               # doctest: +SKIP
        True
        """
        return _torch_interop.from_torch(cls, module)
