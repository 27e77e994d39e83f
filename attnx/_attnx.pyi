"""Type stub of ``attnx._attnx``, the C extension (csrc/python/).

Use the public API in :mod:`attnx` instead: ``forward`` expects arguments that
``attnx.scaled_dot_product_attention`` has already checked and normalised.
"""

from typing import Any, Optional

import numpy as np
from numpy.typing import NDArray

def forward(
    q: NDArray[np.float32],
    k: NDArray[np.float32] | NDArray[np.float16],
    v: NDArray[np.float32] | NDArray[np.float16],
    out: NDArray[np.float32],
    weights: NDArray[np.float32] | None,
    mask: NDArray[np.bool_] | NDArray[np.float32] | NDArray[Any]
          | tuple[NDArray[Any], NDArray[np.uint8]] | None,
    key_lengths: NDArray[np.int64] | None,
    query_lengths: NDArray[np.int64] | None,
    causal: int,
    scale: float,
    lse: NDArray[np.float32] | None = None,
    variant: tuple[bool, int, int, int, float, NDArray[np.float32] | None,
                   NDArray[np.float32] | None, int] | None = None,
    threads: int = 0,
    q_bf16: bool = False,
    /,
) -> None:
    """Private: attention on 4-D float32 views, written into ``out`` (and ``weights``,
    and ``lse`` (B, Hq, Lq, 1)).

    q (B, Hq, Lq, E), k (B, Hk, Lk, E), v (B, Hk, Lk, Ev): any strides with a
    unit last stride (k and v both float16: read as half precision, tile by tile); out (B, Hq, Lq, Ev) writeable; weights None or
    C-contiguous (B, Hq, Lq, Lk); mask None or bool/float32 (B, Hq, Lq, Lk)
    with any strides (0 for broadcast axes); lengths None or int64 (B, Hq);
    causal CAUSAL_NONE, CAUSAL_UPPER_LEFT or CAUSAL_LOWER_RIGHT; variant None or
    (window_on, left, right, align, softcap, alibi_slopes, sinks, precision), the
    arrays None or float32 (B, Hq), precision PRECISION_HIGHEST or PRECISION_MEDIUM; q_bf16: q holds bfloat16 values (with bfloat16 k and v the
    core may then use bfloat16 dot products, see bf16_dots). Releases the GIL.
    """

def forward_varlen(
    q: NDArray[np.float32],
    k: NDArray[Any],
    v: NDArray[Any],
    out: NDArray[np.float32],
    lse: NDArray[np.float32] | None,
    cu_q: NDArray[np.int64],
    cu_k: NDArray[np.int64],
    table: NDArray[np.int32] | None,
    causal: int,
    scale: float,
    variant: tuple[bool, int, int, int, float, NDArray[np.float32] | None,
                   NDArray[np.float32] | None, int] | None = None,
    threads: int = 0,
    q_bf16: bool = False,
    /,
) -> None:
    """Private: attention over N packed sequences, each one problem of the core.

    Sequence i's queries are rows cu_q[i] .. cu_q[i+1] of q (1, Hq, Tq, E), out
    (1, Hq, Tq, Ev) and lse None or (1, Hq, Tq, 1); its keys: rows cu_k[i] ..
    cu_k[i+1] of k (1, Hk, Tk, E) and v (1, Hk, Tk, Ev) when table is None,
    else the first cu_k[i+1] - cu_k[i] rows of its pages table[i] (int32
    (N, M), C-contiguous) of the pools k (P, Hk, S, E) and v (P, Hk, S, Ev).
    k and v float32, float16 or uint16 (bfloat16 bits). variant as forward's,
    alibi_slopes and sinks (N, Hq). Every sequence is checked before any runs;
    releases the GIL.
    """

def bf16_dots() -> Optional[str]:
    """Private (tests): the bfloat16 dot products the kernels in use compute Q·Kᵀ of
    all-bfloat16 inputs with: "amx" (AVX-512 on a CPU with AMX-BF16), "avx512_bf16"
    (AVX-512 on a CPU with AVX512_BF16) or None; ATTNX_BF16_DOTS=amx|avx512_bf16|none
    asks for one the CPU has."""

def isa() -> str:
    """The instruction set the kernels use: "scalar", "avx2", "avx512" or "neon"."""

def set_isa(name: str, /) -> None:
    """Private (tests): use the kernels of ``name``; ValueError if not available here."""

def available_isas() -> list[str]:
    """Instruction sets usable on this CPU (compiled in and supported), e.g. ["scalar", "avx2"]."""

def get_num_threads() -> int:
    """Threads used per call."""

def last_threads() -> int:
    """Private (tests): the threads this thread's last forward ran on."""

def set_num_threads(n: int, /) -> None:
    """Threads used per call; ``n <= 0`` restores the default."""

def use_openmp(on: bool, under: Optional[str] = None, /) -> Optional[str]:
    """Private (attnx.torch): run the calls' threads on the team of an OpenMP runtime
    already loaded (torch's libgomp; the first under the directory ``under`` if there
    is one) if ``on``, else on attnx's pool. Returns the runtime's file when its team
    is used, else None. Only the calls of a thread inside ``on_team(True)`` take it."""

def on_team(on: bool, /) -> bool:
    """Private (attnx.torch): whether this thread's calls may run on the OpenMP team
    ``use_openmp`` found (``True``) or only on attnx's pool (``False``, the default:
    NumPy calls never start that team's threads). Returns the previous setting."""
EXP_FLUSH_BELOW: float
"""exp(x) is exactly 0 below this: a weight of a score further below its row's max is 0."""
ISA_NAMES: tuple[str, ...]
"""Every instruction set the build knows, in order: ("scalar", "avx2", "avx512", "neon")."""
PEAK_UNITS: tuple[str, ...]
"""The units ``peak`` measures, in order: ("fma", "bf16dot", "amx")."""
MAX_THREADS: int
"""The most threads a call uses."""
EMULATED_AVX512: int
"""1 in the test build whose AVX-512 kernels run on SIMDe (tools/emulate.sh), else 0."""

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
    mask: NDArray[np.bool_] | NDArray[np.float32] | NDArray[Any]
          | tuple[NDArray[Any], NDArray[np.uint8]] | None,
    key_lengths: NDArray[np.int64] | None,
    query_lengths: NDArray[np.int64] | None,
    causal: int,
    scale: float,
    variant: tuple[bool, int, int, int, float, NDArray[np.float32] | None,
                   NDArray[np.float32] | None, int] | None = None,
    threads: int = 0,
    /,
) -> None:
    """Private: gradients of ``forward`` written into dq, dk, dv (and dmask, zeroed by the
    caller, a (B, Hq, Lq, Lk) view summed along its stride-0 axes); ``threads`` > 0: this
    call's thread count, as ``forward``'s."""
def fingerprint(a: NDArray[Any], /) -> int:
    """Private: a 64-bit fingerprint of the bytes of ``a`` in its memory order (the GIL
    released): another content gives another value but with probability ~2^-64."""


def peak(unit: str, threads: int, seconds: float, /) -> Optional[float]:
    """Private: the peak of one of ``PEAK_UNITS`` ("fma": FP32 FMAs, "bf16dot":
    vdpbf16ps, "amx": AMX tiles) in the kernels in use, on ``threads`` threads (0:
    the default count), in GFLOP/s, measured in about ``seconds`` (the GIL
    released); None where those kernels lack the unit: the benchmark's compute
    rooflines."""
CAUSAL_NONE: int
"""The ``causal`` code of ``forward``/``backward``: no causal mask."""
CAUSAL_UPPER_LEFT: int
"""Query i sees keys j <= i (PyTorch's is_causal)."""
CAUSAL_LOWER_RIGHT: int
"""Query i sees keys j <= i + Lk - Lq (decoding)."""
ALIGN_UPPER_LEFT: int
"""The ``align`` code of a variant: the diagonal d(i) = i."""
ALIGN_LOWER_RIGHT: int
"""The diagonal d(i) = i + Lk - Lq."""
PRECISION_HIGHEST: int
"""The ``precision`` code of a variant: every product exact to float32."""
PRECISION_MEDIUM: int
"""Products of bfloat16 roundings allowed (computed as HIGHEST by a kernel without them)."""

def classify_mask(mask: NDArray[np.bool_] | NDArray[np.float32] | NDArray[Any], threads: int,
                  /) -> NDArray[np.uint8]:
    """Private: the block map of a bool or float32 mask (B, H, Lq, Lk) (strides 0
    where broadcast): uint8 (nb, nh, nq, nkb), 1 along broadcast axes, one byte a
    block of MAP_ROWS query rows by MAP_KEYS keys, the OR of MAP_KEEP and MAP_DROP.
    Releases the GIL. (A forward's or backward's mask may be a (mask, map) pair.)"""

MAP_ROWS: int
MAP_KEYS: int
MAP_KEEP: int
MAP_DROP: int
