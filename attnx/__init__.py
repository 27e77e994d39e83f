"""attnx: fast, exact masked multi-head attention for NumPy.

``softmax(Q·Kᵀ/√d + mask)·V`` on float32 arrays, computed by a C core with
SIMD kernels chosen at run time.

Public API
----------
scaled_dot_product_attention  PyTorch's F.scaled_dot_product_attention, for NumPy
MultiHeadAttention            the multi-head layer of the seeds (and of torch.nn)
causal_mask, padding_mask     the boolean masks (True = may attend)
reference                     the same attention in float64 NumPy (a test oracle)
get_num_threads, set_num_threads, isa
"""

from . import _attnx
from ._functional import scaled_dot_product_attention
from ._masks import causal_mask, padding_mask
from ._mha import MultiHeadAttention
from ._reference import reference

__version__ = "0.1.0"

__all__ = [
    "scaled_dot_product_attention",
    "MultiHeadAttention",
    "causal_mask",
    "padding_mask",
    "reference",
    "get_num_threads",
    "set_num_threads",
    "isa",
    "__version__",
]


def isa() -> str:
    """The instruction set the kernels run with: "scalar", "avx2" or "avx512".

    Chosen once from the CPU; ``ATTNX_ISA=scalar|avx2|avx512`` in the
    environment (read at import) forces one.
    """
    return _attnx.isa()


def get_num_threads() -> int:
    """Number of threads the C core uses for one call."""
    return _attnx.get_num_threads()


def set_num_threads(n: int) -> None:
    """Set the number of threads the C core uses; ``n <= 0`` restores the default."""
    _attnx.set_num_threads(int(n))
