"""The projections of :class:`attnx.MultiHeadAttention` and their gradients:
the inputs checked against the layer's sizes, ``x @ W + b`` into heads and
back, and the weights' and inputs' gradients through them (NumPy matmuls).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import numpy as np
from numpy.typing import NDArray

from ._args import F32, as_array, as_float, shape_str
from ._mha_weights import LayerWeights


def input_grads(dx: Dict[str, F32], key_defaulted: bool, value_defaulted: bool,
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


class Projections(LayerWeights):
    """The layer's inputs, projections and their gradients."""

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
