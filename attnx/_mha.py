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

The layer's weights (sizes, initialisation, ``parameters``, torch's weights)
are in :mod:`attnx._mha_weights`, the projections and their gradients in
:mod:`attnx._mha_projections`; here are the call and its vjp.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Dict, Literal, Optional, Tuple, Union, overload

import numpy as np
from numpy.typing import NDArray

# (Alignment, Precision, Window: names in the signatures that takes() writes)
from ._args import F32, Alignment, ArrayInput, Causal, Precision, Window, as_float, check_flag, shape_str
from ._functional import scaled_dot_product_attention
from ._grad import attention_vjp
from ._mha_projections import Projections, input_grads
from ._options import Padded, check_names, names, takes
from ._saved import Fingerprints

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["MultiHeadAttention"]

#: the keywords of the layer's **options
_OPTIONS = names(Padded)
_Out = NDArray[np.float32]


class MultiHeadAttention(Projections):
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
        window, sinks, softcap, alibi_slopes, alignment, precision : optional
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
            g.update(input_grads(dx, key is None, value is None, unbatched))
            if ga.sinks is not None:
                g["sinks"] = ga.sinks
            return {n: a.astype(np.float32, copy=False) for n, a in g.items()}

        return (out[0] if unbatched else out), vjp
