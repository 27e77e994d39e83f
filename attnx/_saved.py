"""What a vjp closure keeps of its forward, and the check that nothing it reads
again was modified in place.

A vjp (``scaled_dot_product_attention_vjp``, ``varlen_attention_vjp``,
``MultiHeadAttention.vjp``) recomputes the probabilities from the forward's
inputs when it is called. It keeps private copies of what is small or what
callers commonly modify (the output, a residual connection's ``out += x``; a
layer's weights, which an optimiser updates in place; lengths, sinks and
slopes), and references to the large inputs, with a 64-bit fingerprint of
each (``_attnx.fingerprint``, at ~25 GB/s: a few percent of a forward and
backward at L=1024, less at longer sequences). If one of those was modified
before the vjp runs, the vjp raises a RuntimeError naming it instead of
returning the gradients of other values (PyTorch raises in the same case:
"one of the variables needed for gradient computation has been modified by
an inplace operation").
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

from numpy.typing import NDArray

from . import _attnx


class Fingerprints:
    """Fingerprints of the arrays a vjp will read again, by argument name."""

    def __init__(self, where: str, **arrays: Optional[NDArray[Any]]) -> None:
        self.where = where
        self.prints: List[Tuple[str, NDArray[Any], int]] = [
            (name, a, _attnx.fingerprint(a)) for name, a in arrays.items() if a is not None]

    def check(self) -> None:
        """RuntimeError naming the first array whose contents changed."""
        for name, a, h in self.prints:
            if _attnx.fingerprint(a) != h:
                raise RuntimeError(
                    f"{name} was modified in place after the forward of {self.where}: its vjp "
                    f"reads {name} again, and would give the gradients of other values. Call "
                    f"the vjp before modifying {name}, or give the forward a copy "
                    f"({name}.copy())")
