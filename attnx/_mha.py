"""``MultiHeadAttention``: the Transformer's multi-head attention layer (as torch.nn's).

    Q = query @ W_q + b_q        (B, Lq, H*d_head)  -> (B, Lq, H, d_head)
    K = key   @ W_k + b_k        (B, Lk, H*d_head)  -> (B, Lk, H, d_head)
    V = value @ W_v + b_v        (B, Lk, H*d_head)  -> (B, Lk, H, d_head)
    Z = attention(Q, K, V)       (B, Lq, H, d_head) -> (B, Lq, H*d_head)
    out = Z @ W_o + b_o          (B, Lq, d_model)

The projections are NumPy matmuls (an optimised BLAS); the attention runs in
the C core through :func:`attnx.scaled_dot_product_attention` with
``layout="blhd"``, which reads the (B, L, H, d_head) projections as they are,
with no transpose copy.
"""

from __future__ import annotations

from typing import (TYPE_CHECKING, Any, Callable, Dict, Literal, Optional, SupportsIndex, Tuple,
                    TypeVar, Union, overload)

import numpy as np
from numpy.typing import NDArray

from . import _torch_interop
# (Alignment, Window: names in the signatures that takes() writes)
from ._args import (F32, Alignment, ArrayInput, Causal, Window, as_array, as_float, check_flag,
                    positive_int, shape_str)
from ._functional import scaled_dot_product_attention
from ._grad import attention_vjp
from ._options import Padded, check_names, names, takes
from ._saved import Fingerprints

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["MultiHeadAttention"]

#: the keywords of the layer's **options
_OPTIONS = names(Padded)
_Out = NDArray[np.float32]

_M = TypeVar("_M", bound="MultiHeadAttention")


def _input_grads(dx: Dict[str, F32], key_defaulted: bool, value_defaulted: bool,
                 unbatched: bool) -> Dict[str, F32]:
    """The gradients of query, key and value from those through the projections
    ``dx["q"]``, ``dx["k"]``, ``dx["v"]``: an input that defaulted to another
    (key to query, value to key) adds into that one's."""
    g = {"query": dx["q"]}
    k_into = "query" if key_defaulted else "key"
    v_into = k_into if value_defaulted else "value"
    for into, d in ((k_into, dx["k"]), (v_into, dx["v"])):
        g[into] = g[into] + d if into in g else d
    return {n: a[0] if unbatched else a for n, a in g.items()}


def _xavier(rng: np.random.Generator, fan_in: int, fan_out: int) -> F32:
    """Xavier/Glorot uniform: U(-a, a), a = sqrt(6 / (fan_in + fan_out)); (fan_in, fan_out) float32."""
    a = np.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-a, a, size=(fan_in, fan_out)).astype(np.float32)


class MultiHeadAttention:
    """Multi-head attention with NumPy weights, the Transformer's layer (as ``torch.nn.MultiheadAttention``).

    ``out = concat(head_1, ..., head_H) @ W_o + b_o`` with
    ``head_h = softmax(Q_h K_hᵀ / sqrt(d_head) + mask) V_h`` and
    ``Q = query @ W_q + b_q``, ``K = key @ W_k + b_k``, ``V = value @ W_v + b_v``.

    Shapes (see :meth:`__call__`): ``layer(query, key, value)`` takes query
    (B, Lq, d_model), key (B, Lk, kdim), value (B, Lk, vdim) (batch-first;
    unbatched (L, features) works too) and returns (B, Lq, d_model), plus the
    weights (B, H, Lq, Lk) with ``need_weights=True``. ``attn_mask``: bool,
    True = may attend (torch's MHA: the opposite), or float, added to the
    scores; broadcastable to (B, H, Lq, Lk). The user guide's page "The
    multi-head layer" (:doc:`/guide/mha`) explains the layer, its weights and
    how it differs from torch's.

    Parameters
    ----------
    d_model : int
        Features of the query (and of the output); need not divide by ``num_heads``.
    num_heads : int
        Number of heads H.
    d_head : int, optional
        Features per head; defaults to ``max(1, d_model // num_heads)``.
    bias : bool
        Whether the four projections have biases (initialised to zeros).
    kdim, vdim : int, optional
        Features of key and value; default ``d_model``.
    seed : int or numpy.random.Generator, optional
        Seed of ``np.random.default_rng`` for the initial (Xavier-uniform) weights.

    Attributes
    ----------
    W_q : ndarray, float32, (d_model, H*d_head)
    W_k : ndarray, float32, (kdim, H*d_head)
    W_v : ndarray, float32, (vdim, H*d_head)
    W_o : ndarray, float32, (H*d_head, d_model)
    b_q, b_k, b_v : ndarray, float32, (H*d_head,), or None when ``bias=False``
    b_o : ndarray, float32, (d_model,), or None when ``bias=False``
        Plain arrays: assign or modify them in place to set weights.

    Examples
    --------
    >>> import numpy as np, attnx
    >>> mha = attnx.MultiHeadAttention(50, 8, seed=0)   # GloVe-50, d_head = 6
    >>> mha
    MultiHeadAttention(d_model=50, num_heads=8, d_head=6, bias=True)
    >>> x = np.random.default_rng(1).standard_normal((2, 7, 50), dtype=np.float32)
    >>> mha(x, is_causal=True, key_lengths=[7, 4]).shape      # decoder self-attention
    (2, 7, 50)
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

    # ------------------------------------------------------------------ helpers

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

    # --------------------------------------------------------------------- call

    # need_weights=True adds the weights; the options are declared once, in attnx._options
    @overload
    def __call__(self, query: ArrayInput, key: Optional[ArrayInput] = None,
                 value: Optional[ArrayInput] = None, *, attn_mask: Optional[ArrayInput] = None,
                 is_causal: Causal = False, need_weights: Literal[False] = False,
                 average_weights: bool = False, **options: Unpack[Padded]) -> _Out: ...
    @overload
    def __call__(self, query: ArrayInput, key: Optional[ArrayInput] = None,
                 value: Optional[ArrayInput] = None, *, attn_mask: Optional[ArrayInput] = None,
                 is_causal: Causal = False, need_weights: Literal[True],
                 average_weights: bool = False, **options: Unpack[Padded]) -> Tuple[_Out, _Out]: ...
    @overload
    def __call__(self, query: ArrayInput, key: Optional[ArrayInput] = None,
                 value: Optional[ArrayInput] = None, *, attn_mask: Optional[ArrayInput] = None,
                 is_causal: Causal = False, need_weights: bool = False,
                 average_weights: bool = False,
                 **options: Unpack[Padded]) -> Union[_Out, Tuple[_Out, _Out]]: ...

    @takes(Padded, before="need_weights")
    def __call__(self, query: ArrayInput, key: Optional[ArrayInput] = None,
                 value: Optional[ArrayInput] = None, *, attn_mask: Optional[ArrayInput] = None,
                 is_causal: Causal = False, need_weights: bool = False,
                 average_weights: bool = False, **options: Unpack[Padded],
                 ) -> Union[NDArray[np.float32], Tuple[NDArray[np.float32], NDArray[np.float32]]]:
        """Attend from ``query`` to ``key``/``value``.

        Parameters
        ----------
        query : array_like, (B, Lq, d_model) or unbatched (Lq, d_model)
        key : array_like, (B, Lk, kdim) or (Lk, kdim), optional
            Defaults to ``query`` (self-attention).
        value : array_like, (B, Lk, vdim) or (Lk, vdim), optional
            Defaults to ``key`` (so to ``query`` when both are omitted).
            float16/float64 inputs are converted; the result is float32.
            Inputs may be NumPy arrays, PyTorch CPU tensors (also ones that
            require grad; no gradient flows back) or anything with
            ``__array__`` or ``__dlpack__``; the result is a NumPy array.
        attn_mask : array_like, optional
            bool, **True = may attend** (the opposite of
            ``torch.nn.MultiheadAttention``'s bool mask, where True = blocked),
            or float, added to the scores (-inf blocks). Broadcastable to
            (B, H, Lq, Lk): (Lq, Lk), (B, 1, Lq, Lk) (a Transformer tutorial's masks, see
            :func:`attnx.padding_mask`), (B, H, Lq, Lk). For unbatched inputs:
            (Lq, Lk) or (H, Lq, Lk). A 3-D mask with batched inputs is refused
            as ambiguous (it would broadcast as (H, Lq, Lk), while torch reads
            (B*H, Lq, Lk) and tutorial code often means (B, Lq, Lk)): pass
            ``mask[:, None]`` for (B, Lq, Lk), ``mask[None]`` for (H, Lq, Lk).
        is_causal : bool or str
            True (or "upper_left"): query i sees keys j <= i. "lower_right":
            j <= i + Lk - Lq. Combined with the mask and the lengths by AND
            (a Transformer decoder's causal AND padding).
        key_lengths : array_like of int, (B,) (a scalar when unbatched), optional
            Keys at positions >= key_lengths[b] are ignored: torch's
            ``key_padding_mask`` (True = pad) is ``arange(Lk) >= key_lengths[:, None]``.
        query_lengths : array_like of int, (B,), optional
            Query rows at positions >= query_lengths[b] attend to nothing: their
            attention output is zero, so their result is ``b_o``. For an
            encoder's padding mask (both tokens real) pass the same lengths as
            ``key_lengths`` and ``query_lengths``.
        window, sinks, softcap, alibi_slopes, alignment : optional
            The attention variants, as in :func:`attnx.scaled_dot_product_attention`
            (sinks and slopes per head: (H,) or (B, H)).
        need_weights : bool
            Also return the attention weights.
        average_weights : bool
            Return the weights averaged over the heads (torch's default).

        Returns
        -------
        out : ndarray, float32, (B, Lq, d_model) (unbatched: (Lq, d_model))
        weights : ndarray, float32, (B, H, Lq, Lk), or (B, Lq, Lk) with
            ``average_weights``; without the B axis when unbatched. Only
            returned when ``need_weights``.

        Examples
        --------
        >>> import numpy as np, attnx
        >>> mha = attnx.MultiHeadAttention(100, 6, seed=0)     # d_head = 16
        >>> x = np.zeros((3, 10, 100), dtype=np.float32)
        >>> out, w = mha(x, key_lengths=[10, 8, 3], need_weights=True, average_weights=True)
        >>> out.shape, w.shape
        ((3, 10, 100), (3, 10, 10))
        >>> float(w[2, 0, 3:].sum())                             # padded keys get no weight
        0.0
        """
        need_weights = check_flag(need_weights, "need_weights")
        average_weights = check_flag(average_weights, "average_weights")
        check_names(options, _OPTIONS, "MultiHeadAttention.__call__")
        q_in, k_in, v_in, attn_mask, unbatched = self._inputs(query, key, value, attn_mask)
        q, k, v = self._project(q_in, k_in, v_in)
        res = scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                           layout="blhd", need_weights=need_weights, **options)
        z, w = (res[0], res[1]) if isinstance(res, tuple) else (res, None)
        out = self._output(z)
        if unbatched:
            out = out[0]
        if w is None:
            return out
        if average_weights:  # (B, H, Lq, Lk) -> (B, Lq, Lk), summed in float64
            w = w.mean(axis=1, dtype=np.float64).astype(np.float32)
        if unbatched:
            w = w[0]
        return out, w

    def _inputs(self, query: object, key: object, value: object, attn_mask: object) -> Tuple[
            F32, F32, F32, Optional[NDArray[Any]], bool]:
        """The inputs as float32 (B, L, features) arrays (key defaults to query,
        value to key), the mask, and whether they came unbatched."""
        self._check_parameters()
        q_in = as_float(query, "query")
        k_in = q_in if key is None else as_float(key, "key")
        v_in = k_in if value is None else as_float(value, "value")
        self._check_inputs(q_in, k_in, v_in, key is None, value is None)
        unbatched = q_in.ndim == 2
        if unbatched:
            q_in, k_in, v_in = q_in[None], k_in[None], v_in[None]
        mask = None
        if attn_mask is not None:
            mask = self._mask(attn_mask, (q_in.shape[0], self.num_heads, q_in.shape[1], k_in.shape[1]),
                              unbatched)
        return q_in, k_in, v_in, mask, unbatched

    def _check_inputs(self, q_in: F32, k_in: F32, v_in: F32, key_defaulted: bool,
                      value_defaulted: bool) -> None:
        """ValueError unless query, key and value fit the layer and each other."""
        def shapes() -> str:
            return (f"query {shape_str(q_in)}, key {shape_str(k_in)}, value {shape_str(v_in)} "
                    f"for {self!r} (kdim={self.kdim}, vdim={self.vdim})")

        k_name = "key (defaulted to query)" if key_defaulted else "key"
        v_name = "value" if not value_defaulted else (
            "value (defaulted to query)" if key_defaulted else "value (defaulted to key)")
        for a, name in ((q_in, "query"), (k_in, k_name), (v_in, v_name)):
            if a.ndim not in (2, 3):
                raise ValueError(f"{name} must be (B, L, features) or unbatched (L, features); "
                                 f"got shape {shape_str(a)}")
        if not (q_in.ndim == k_in.ndim == v_in.ndim):
            raise ValueError(f"query, key and value must all be batched (B, L, features) or all "
                             f"unbatched (L, features); got {shapes()}")
        for a, name, dim, attr in ((q_in, "query", self.d_model, "d_model"),
                                   (k_in, k_name, self.kdim, "kdim"),
                                   (v_in, v_name, self.vdim, "vdim")):
            if a.shape[-1] != dim:
                raise ValueError(f"{name} has {a.shape[-1]} features but the layer's {attr} is "
                                 f"{dim}; got {shapes()}")
        if k_in.shape[-2] != v_in.shape[-2]:
            raise ValueError(f"key and value must have the same length Lk; got {shapes()}")
        if q_in.ndim == 3 and not (q_in.shape[0] == k_in.shape[0] == v_in.shape[0]):
            raise ValueError(f"query, key and value must have the same batch size B; got {shapes()}")

    @staticmethod
    def _mask(attn_mask: object, scores: Tuple[int, int, int, int], unbatched: bool) -> NDArray[Any]:
        """The mask as an array; ValueError for the shapes that would broadcast to
        ``scores`` (B, H, Lq, Lk) in a way the caller did not mean."""
        m = as_array(attn_mask, "attn_mask")
        if m.ndim == 3 and not unbatched and m.shape[0] != 1:
            raise ValueError(
                f"a 3-D attn_mask {shape_str(m)} is ambiguous for batched inputs: pass "
                f"mask[:, None] for a (B, Lq, Lk) mask, mask[None] for (H, Lq, Lk), or "
                f"mask.reshape(B, H, Lq, Lk) for torch's (B*H, Lq, Lk)")
        if m.ndim > 4 or (unbatched and m.ndim == 4 and m.shape[0] != 1):
            raise ValueError(f"attn_mask {shape_str(m)} must broadcast to (B, H, Lq, Lk) = "
                             f"{scores}{' (unbatched: (H, Lq, Lk))' if unbatched else ''}")
        return m

    def _project(self, q_in: NDArray[np.float32], k_in: NDArray[np.float32],
                 v_in: NDArray[np.float32]) -> Tuple[NDArray[Any], NDArray[Any], NDArray[Any]]:
        """(B, L, features) @ (features, H*D) + b -> (B, L, H*D) -> views (B, L, H, D)."""
        B, Lq, Lk = q_in.shape[0], q_in.shape[1], k_in.shape[1]
        H, D = self.num_heads, self.d_head
        q = q_in @ self.W_q
        k = k_in @ self.W_k
        v = v_in @ self.W_v
        if self.b_q is not None:
            q += self.b_q
        if self.b_k is not None:
            k += self.b_k
        if self.b_v is not None:
            v += self.b_v
        return q.reshape(B, Lq, H, D), k.reshape(B, Lk, H, D), v.reshape(B, Lk, H, D)

    def _output(self, z: NDArray[Any]) -> NDArray[np.float32]:
        """(B, Lq, H, D) -> (B, Lq, H*D) @ (H*D, d_model) + b_o -> (B, Lq, d_model)."""
        out = z.reshape(z.shape[0], z.shape[1], z.shape[2] * z.shape[3]) @ self.W_o
        if self.b_o is not None:
            out += self.b_o
        return out.astype(np.float32, copy=False)

    # -------------------------------------------------------------- gradients

    def parameters(self) -> Dict[str, NDArray[np.float32]]:
        """The layer's arrays by name (W_q, W_k, W_v, W_o, and b_q, b_k, b_v, b_o
        when it has biases): the live arrays, so an optimiser updates them in place
        (``p -= lr * grads[name]``)."""
        names = ("W_q", "W_k", "W_v", "W_o", "b_q", "b_k", "b_v", "b_o")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    @takes(Padded)
    def vjp(self, query: ArrayInput, key: Optional[ArrayInput] = None,
            value: Optional[ArrayInput] = None, *, attn_mask: Optional[ArrayInput] = None,
            is_causal: Causal = False, **options: Unpack[Padded],
            ) -> Tuple[NDArray[np.float32], Callable[[ArrayInput], Dict[str, NDArray[np.float32]]]]:
        """The layer's output and a function of its cotangent, for training.

        Same arguments as calling the layer (without the weights). Returns
        ``(out, vjp)``; ``vjp(dout)``, ``dout`` shaped like ``out``, returns a
        dict of float32 gradients: ``"query"`` (and ``"key"``, ``"value"`` when
        they were passed; an input that defaulted to another adds into that
        one's gradient), one entry per array of :meth:`parameters`, under
        the same names, and ``"sinks"`` when sinks were passed. The attention's backward is attnx's fused kernel; the
        projections' are NumPy matmuls.

        The gradients are those of the forward that was computed: the weights
        are copied when it runs (an optimiser may update them in place before
        ``vjp`` is called), and so is the output; the inputs (and a mask) are
        kept by reference with a fingerprint, and ``vjp`` raises RuntimeError
        naming one that was modified in place in between.

        Example
        -------
        >>> import numpy as np, attnx
        >>> mha = attnx.MultiHeadAttention(16, 2, seed=0)
        >>> x = np.random.default_rng(0).standard_normal((3, 5, 16), dtype=np.float32)
        >>> out, vjp = mha.vjp(x, is_causal=True)
        >>> grads = vjp(np.ones_like(out))
        >>> sorted(grads) == sorted(["query", *mha.parameters()])
        True
        >>> for name, p in mha.parameters().items():    # one step of gradient descent
        ...     p -= 0.01 * grads[name]
        """
        check_names(options, _OPTIONS, "MultiHeadAttention.vjp")
        q_in, k_in, v_in, mask, unbatched = self._inputs(query, key, value, attn_mask)
        weights = {n: w.copy() for n, w in self.parameters().items() if n.startswith("W_")}
        prints = Fingerprints("MultiHeadAttention.vjp", query=q_in, key=k_in, value=v_in,
                              attn_mask=mask)
        q, k, v = self._project(q_in, k_in, v_in)
        z, attn_vjp = attention_vjp(q, k, v, attn_mask=mask, is_causal=is_causal, layout="blhd",
                                    where=None, **options)
        out = self._output(z)
        shape = out.shape

        def vjp(dout: ArrayInput) -> Dict[str, F32]:
            prints.check()
            do = as_float(dout, "dout")
            do = do[None] if unbatched else do
            if do.shape != shape:
                raise ValueError(f"dout must have the output's shape {shape[unbatched:]}; "
                                 f"got {shape_str(do)}")
            g, dz = self._output_grads(z, do, weights["W_o"])
            ga = attn_vjp(dz)
            dx = {n: self._projection_grads(n, x, gp, g, weights["W_" + n])
                  for n, x, gp in (("q", q_in, ga.query), ("k", k_in, ga.key), ("v", v_in, ga.value))}
            g.update(_input_grads(dx, key is None, value is None, unbatched))
            if ga.sinks is not None:
                g["sinks"] = ga.sinks
            return {n: a.astype(np.float32, copy=False) for n, a in g.items()}

        return (out[0] if unbatched else out), vjp

    def _output_grads(self, z: NDArray[Any], do: F32,
                      W_o: F32) -> Tuple[Dict[str, F32], NDArray[Any]]:
        """The gradients of W_o (and b_o) for ``do`` (B, Lq, d_model), and that of
        the heads ``z`` (B, Lq, H, D), through the forward's ``W_o``."""
        zf = z.reshape(-1, z.shape[2] * z.shape[3])                 # (B*Lq, H*D)
        do2 = do.reshape(-1, do.shape[-1])                          # (B*Lq, d_model)
        g = {"W_o": zf.T @ do2}
        if self.b_o is not None:
            g["b_o"] = do2.sum(axis=0)
        return g, (do2 @ W_o.T).reshape(z.shape)

    def _projection_grads(self, n: str, x: F32, gp: NDArray[Any], g: Dict[str, F32],
                          W_n: F32) -> F32:
        """Adds to ``g`` the gradients of W_n (and b_n), n in "q", "k", "v", for the
        gradient ``gp`` (B, L, H, D) of the projection of ``x`` (B, L, features);
        returns the gradient of ``x`` through the forward's ``W_n``."""
        gp2 = gp.reshape(-1, gp.shape[2] * gp.shape[3])             # (B*L, H*D)
        g["W_" + n] = x.reshape(-1, x.shape[-1]).T @ gp2
        if getattr(self, "b_" + n) is not None:
            g["b_" + n] = gp2.sum(axis=0)
        dx: F32 = (gp2 @ W_n.T).reshape(x.shape)
        return dx

    # -------------------------------------------------------------------- torch

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
