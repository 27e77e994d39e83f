"""Type stub of ``attnx._attnx``, the C extension (csrc/module.c).

Use the public API in :mod:`attnx` instead: ``forward`` expects arguments that
``attnx.scaled_dot_product_attention`` has already checked and normalised.
"""

from typing import Any

import numpy as np
from numpy.typing import NDArray

def forward(
    q: NDArray[np.float32],
    k: NDArray[np.float32],
    v: NDArray[np.float32],
    out: NDArray[np.float32],
    weights: NDArray[np.float32] | None,
    mask: NDArray[np.bool_] | NDArray[np.float32] | NDArray[Any] | None,
    key_lengths: NDArray[np.int64] | None,
    query_lengths: NDArray[np.int64] | None,
    causal: int,
    scale: float,
    lse: NDArray[np.float32] | None = None,
    /,
) -> None:
    """Private: attention on 4-D float32 views, written into ``out`` (and ``weights``,
    and ``lse`` (B, Hq, Lq, 1)).

    q (B, Hq, Lq, E), k (B, Hk, Lk, E), v (B, Hk, Lk, Ev): any strides with a
    unit last stride; out (B, Hq, Lq, Ev) writeable; weights None or
    C-contiguous (B, Hq, Lq, Lk); mask None or bool/float32 (B, Hq, Lq, Lk)
    with any strides (0 for broadcast axes); lengths None or int64 (B, Hq);
    causal 0 none, 1 upper-left, 2 lower-right. Releases the GIL.
    """

def isa() -> str:
    """The instruction set the kernels use: "scalar", "avx2", "avx512" or "neon"."""

def set_isa(name: str, /) -> None:
    """Private (tests): use the kernels of ``name``; ValueError if not available here."""

def available_isas() -> list[str]:
    """Instruction sets usable on this CPU (compiled in and supported), e.g. ["scalar", "avx2"]."""

def get_num_threads() -> int:
    """Threads used per call."""

def set_num_threads(n: int, /) -> None:
    """Threads used per call; ``n <= 0`` restores the default."""
EXP_FLUSH_BELOW: float
ISA_NAMES: tuple[str, ...]
MAX_THREADS: int

def backward(
    q: NDArray[np.float32],
    k: NDArray[np.float32],
    v: NDArray[np.float32],
    out: NDArray[np.float32],
    dout: NDArray[np.float32],
    lse: NDArray[np.float32],
    dq: NDArray[np.float32],
    dk: NDArray[np.float32],
    dv: NDArray[np.float32],
    dmask: NDArray[np.float32] | None,
    mask: NDArray[np.bool_] | NDArray[np.float32] | NDArray[Any] | None,
    key_lengths: NDArray[np.int64] | None,
    query_lengths: NDArray[np.int64] | None,
    causal: int,
    scale: float,
    /,
) -> None:
    """Private: gradients of ``forward`` written into dq, dk, dv (and dmask, zeroed by the caller)."""
CAUSAL_NONE: int
CAUSAL_UPPER_LEFT: int
CAUSAL_LOWER_RIGHT: int
