"""attnx: fast, exact masked multi-head attention for NumPy.

``softmax(Q·Kᵀ/√d + mask)·V`` on float32 arrays, computed by a C core with
SIMD kernels chosen at run time.

Public API
----------
scaled_dot_product_attention  PyTorch's F.scaled_dot_product_attention, for NumPy
MultiHeadAttention            the Transformer's multi-head layer (as torch.nn's)
causal_mask, padding_mask     the boolean masks (True = may attend)
BlockMask                     a mask classified once: its empty blocks skipped
reference                     the same attention in float64 NumPy (a test oracle)
plot_attention                heatmaps of attention weights (needs matplotlib: attnx[plot])
get_num_threads, set_num_threads, isa
"""

try:
    from . import _attnx as _attnx
except ImportError:
    # Without a built extension in this directory, Python's own message would blame
    # "a circular import". Say what happened instead (as NumPy does), unless an
    # extension file for this Python is here and failed to load: that error is real.
    import importlib.machinery as _machinery
    import os as _os

    _here = _os.path.dirname(_os.path.abspath(__file__))
    if any(_os.path.exists(_os.path.join(_here, "_attnx" + _suffix))
           for _suffix in _machinery.EXTENSION_SUFFIXES):
        raise
    raise ImportError(
        f"cannot import attnx from {_here}: its C extension attnx._attnx is not built "
        f"there (no _attnx{_machinery.EXTENSION_SUFFIXES[0]}). This is most likely "
        "attnx's source tree, found first because Python was started from its root "
        "(the current directory comes first on sys.path and shadows an installed attnx). "
        f"Either build the extension in place: run `pip install -e .` in "
        f"{_os.path.dirname(_here)}; or, after `pip install .`, run Python from "
        "another directory.",
        name="attnx._attnx", path=_here,
    ) from None
from ._args import integer as _integer
from ._functional import scaled_dot_product_attention
from ._grad import (AttentionGrads, merge_attention, reference_backward,
                    scaled_dot_product_attention_backward, scaled_dot_product_attention_vjp)
from ._masks import causal_mask, padding_mask
from ._blockmask import BlockMask
from ._mha import MultiHeadAttention
from ._plot import plot_attention
from ._reference import reference
from ._varlen import pack, unpack, varlen_attention, varlen_attention_vjp
from ._kvcache import KVCache
from ._int8 import dequantize_int8, int8_rotation, quantize_int8

__version__ = "0.1.0"

__all__ = [
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_vjp",
    "scaled_dot_product_attention_backward",
    "AttentionGrads",
    "merge_attention",
    "reference_backward",
    "MultiHeadAttention",
    "causal_mask",
    "padding_mask",
    "BlockMask",
    "plot_attention",
    "reference",
    "varlen_attention",
    "varlen_attention_vjp",
    "pack",
    "unpack",
    "KVCache",
    "quantize_int8",
    "dequantize_int8",
    "int8_rotation",
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
    ``torch.set_num_threads``). ``n`` must be an integer (TypeError otherwise,
    bools included) of at most 2**20 (ValueError); more threads than the
    core's maximum use that maximum (``get_num_threads()`` tells).

    Example
    -------
    >>> import attnx
    >>> attnx.set_num_threads(1)
    >>> attnx.get_num_threads()
    1
    >>> attnx.set_num_threads(0)      # back to the default
    """
    count = _integer(n, "n", "an integer number of threads")
    if count > 1 << 20:
        raise ValueError(f"n must be at most {1 << 20} threads (n <= 0 restores the default); got {count}")
    _attnx.set_num_threads(max(count, 0))


def __getattr__(name: str) -> object:
    """``attnx.torch``, ``attnx.dask`` and ``attnx.integrations`` import on first
    use (they import torch, dask, transformers; ``import attnx`` does not)."""
    if name in ("torch", "dask", "integrations"):
        import importlib

        return importlib.import_module("." + name, __name__)
    raise AttributeError(f"module 'attnx' has no attribute {name!r}")
