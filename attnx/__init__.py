"""attnx: fast, exact masked multi-head attention for NumPy.

``softmax(Q·Kᵀ/√d + mask)·V`` on float32 arrays, computed by a C core with
SIMD kernels chosen at run time.

Public API
----------
scaled_dot_product_attention  PyTorch's F.scaled_dot_product_attention, for NumPy
MultiHeadAttention            the multi-head layer of the seeds (and of torch.nn)
causal_mask, padding_mask     the boolean masks (True = may attend)
reference                     the same attention in float64 NumPy (a test oracle)
plot_attention                heatmaps of attention weights (needs matplotlib: attnx[plot])
get_num_threads, set_num_threads, isa
"""

from . import _attnx as _attnx
from ._functional import scaled_dot_product_attention
from ._masks import causal_mask, padding_mask
from ._mha import MultiHeadAttention
from ._plot import plot_attention
from ._reference import reference

__version__ = "0.1.0"

__all__ = [
    "scaled_dot_product_attention",
    "MultiHeadAttention",
    "causal_mask",
    "padding_mask",
    "plot_attention",
    "reference",
    "get_num_threads",
    "set_num_threads",
    "isa",
    "__version__",
]


def isa() -> str:
    """The instruction set the kernels run with: "scalar", "avx2" or "avx512".

    Chosen once from the CPU; ``ATTNX_ISA=scalar|avx2|avx512`` in the
    environment (read at import) forces one. ("neon" on 64-bit ARM.) A name
    that is unknown or not available on this CPU is ignored: the best
    available set is used, and ``python -m attnx info`` prints a warning.

    Example
    -------
    >>> import attnx
    >>> attnx.isa() in ("scalar", "avx2", "avx512", "neon")
    True
    """
    return _attnx.isa()


def get_num_threads() -> int:
    """Number of threads the C core uses for one call.

    The default is ``ATTNX_NUM_THREADS`` (or ``OMP_NUM_THREADS``) when set to
    an integer from 1 to 256, else one thread per CPU available to the process.

    Example
    -------
    >>> import attnx
    >>> attnx.get_num_threads() >= 1
    True
    """
    return _attnx.get_num_threads()


def set_num_threads(n: int) -> None:
    """Set the number of threads the C core uses; ``n <= 0`` restores the default.

    Applies to every later call, from any Python thread (process-wide, like
    ``torch.set_num_threads``).

    Example
    -------
    >>> import attnx
    >>> attnx.set_num_threads(1)
    >>> attnx.get_num_threads()
    1
    >>> attnx.set_num_threads(0)      # back to the default
    """
    _attnx.set_num_threads(int(n))
