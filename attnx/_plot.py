"""``plot_attention``: attention weights as a labelled heatmap (matplotlib, optional).

matplotlib is imported only when a plot is made, so ``import attnx`` works
without it; ``pip install "attnx[plot]"`` installs it.
"""

from __future__ import annotations

import math
import os
import sys
from typing import TYPE_CHECKING, Any, List, Literal, Optional, Sequence, Tuple, Union

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ._args import as_array, integer, shape_str

if TYPE_CHECKING:  # matplotlib is optional: its types only matter to a type checker
    from matplotlib.axes import Axes
    from matplotlib.colors import Colormap
    from matplotlib.figure import Figure

__all__ = ["plot_attention"]

_INSTALL = 'pip install "attnx[plot]"'
_CELL = 0.42           # inches per token
_MAX_LABELS = 40       # more tokens than this: label every k-th one


def _headless() -> bool:
    """True on a Linux/BSD machine with no display (a CI job, ssh, a container)."""
    if not sys.platform.startswith(("linux", "freebsd", "openbsd", "netbsd")):
        return False
    return not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def _pyplot() -> Any:
    """matplotlib.pyplot, imported on first use; ImportError saying what to install."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError(
            f"attnx.plot_attention needs matplotlib, which is not installed: {_INSTALL} "
            f"(or pip install matplotlib)") from None
    if "matplotlib.pyplot" not in sys.modules and _headless() and not os.environ.get("MPLBACKEND"):
        # Nobody chose a backend (no MPLBACKEND: Jupyter kernels set it to their
        # inline backend, so notebooks never get here) and there is no display:
        # use Agg rather than let pyplot probe GUI toolkits. A backend set in a
        # matplotlibrc is respected.
        get = getattr(matplotlib.rcParams, "_get_backend_or_none", None)
        if get is not None and get() is None:
            matplotlib.use("Agg")
    try:
        import matplotlib.pyplot as plt
    except ImportError as exc:  # a broken installation: say so, with the cause
        raise ImportError(f"attnx.plot_attention could not import matplotlib.pyplot ({exc}); "
                          f"{_INSTALL} installs a working matplotlib") from exc
    return plt


def _as_weights(weights: Any) -> Tuple[NDArray[np.float64], bool]:
    """(``weights`` as a float64 ndarray, whether it was a bool mask); TypeError naming the dtype."""
    if isinstance(weights, tuple) and len(weights) == 2 and all(hasattr(a, "shape") for a in weights):
        raise TypeError(
            "weights is a pair; if it is (out, weights) from scaled_dot_product_attention(..., "
            "need_weights=True), pass the second item")
    if hasattr(weights, "detach") and hasattr(weights, "cpu"):  # a torch tensor, maybe requiring grad
        weights = weights.detach().cpu()
    # the conversion of every attnx function: lazy torch bits resolved, DLPack,
    # masked arrays refused (float64 is drawn as it is: no float32 range check)
    w = as_array(weights, "weights", float32_range=False)
    is_mask = w.dtype == np.bool_        # a mask: True = may attend, drawn as 1.0
    if not is_mask and not (np.issubdtype(w.dtype, np.floating) or np.issubdtype(w.dtype, np.integer)):
        raise TypeError(f"weights must be real numbers (or bool); got dtype {w.dtype} with shape {shape_str(w)}")
    return w.astype(np.float64, copy=False), is_mask


def _select_heads(w: NDArray[np.float64], head: Any
                  ) -> Tuple[List[NDArray[np.float64]], List[Optional[str]]]:
    """(heads, labels): a list of (Lq, Lk) arrays and their titles (None for a plain matrix)."""
    shape = shape_str(w)
    if w.ndim == 4:
        if w.shape[0] != 1:
            raise ValueError(
                f"weights of shape {shape} hold a batch of {w.shape[0]}; plot one item at a time, "
                f"e.g. weights[0] of shape {shape_str(w[0])}")
        w = w[0]
    elif w.ndim not in (2, 3):
        raise ValueError(
            f"weights must be (Lq, Lk), (H, Lq, Lk) or (1, H, Lq, Lk); got shape {shape}")
    if w.shape[-2] == 0 or w.shape[-1] == 0 or (w.ndim == 3 and w.shape[0] == 0):
        raise ValueError(f"weights of shape {shape} are empty: nothing to plot")

    if w.ndim == 2:
        if head is not None:
            raise ValueError(f"head={head!r} was given but weights of shape {shape} have no head axis "
                             f"(pass (H, Lq, Lk) or (1, H, Lq, Lk) weights)")
        return [w], [None]

    picked = list(range(w.shape[0])) if head is None else _head_indices(head, w.shape[0], shape)
    return [w[h] for h in picked], [f"head {h}" for h in picked]


def _head_indices(head: Any, H: int, shape: str) -> List[int]:
    """``head`` (an int or a sequence of ints, negative from the end) as indices in [0, H)."""
    many = not isinstance(head, (int, np.integer)) and np.ndim(head) == 1
    items = list(head) if many else [head]
    if not items:
        raise ValueError("head is an empty sequence: nothing to plot")
    picked = []
    for item in items:
        h = integer(item, "head", "an int or a sequence of ints")
        if not -H <= h < H:
            raise ValueError(f"head {h} is out of range for weights of shape {shape} with {H} heads")
        picked.append(h % H)
    return picked


def _tokens(tokens: Any, n: int, name: str, axis: str, shape: str) -> Optional[List[str]]:
    """``tokens`` as a list of n strings (or None); errors name the length and the shape."""
    if tokens is None:
        return None
    if isinstance(tokens, (str, bytes)):
        raise TypeError(f"{name} must be a sequence of tokens, not a string; use e.g. sentence.split()")
    try:
        labels = [str(t) for t in tokens]
    except TypeError:
        raise TypeError(f"{name} must be a sequence of tokens; got {type(tokens).__name__}") from None
    if len(labels) != n:
        raise ValueError(f"{name} has {len(labels)} tokens but weights of shape {shape} have {n} "
                         f"{axis} (rows are queries, columns are keys)")
    return labels


def _columns(n: int) -> int:
    """Heads per row of the grid: 1-3 in a row, 4 as 2x2, 5-6 as 3 per row, then 4 per row."""
    return n if n <= 3 else {4: 2, 5: 3, 6: 3}.get(n, 4)


def _set_ticks(ax: Any, axis: str, labels: Optional[List[str]], n: int) -> None:
    """One tick per token (every k-th when there are many); positions when no tokens are given."""
    target = ax.xaxis if axis == "x" else ax.yaxis
    if labels is None:
        from matplotlib.ticker import MaxNLocator
        target.set_major_locator(MaxNLocator(nbins=8, integer=True))
        return
    step = max(1, math.ceil(n / _MAX_LABELS))
    ticks = list(range(0, n, step))
    text = [labels[i] for i in ticks]
    size = "medium" if len(ticks) <= 25 else "small"
    if axis == "x":
        ax.set_xticks(ticks)
        ax.set_xticklabels(text, rotation=60, ha="right", rotation_mode="anchor", fontsize=size)
    else:
        ax.set_yticks(ticks)
        ax.set_yticklabels(text, fontsize=size)


def plot_attention(weights: ArrayLike, query_tokens: Optional[Sequence[str]] = None,
                   key_tokens: Optional[Sequence[str]] = None, *,
                   head: Union[int, Sequence[int], None] = None, ax: Optional[Axes] = None,
                   cmap: Union[str, Colormap] = "viridis", title: Optional[str] = None) -> Figure:
    """Plot attention weights as a heatmap: rows are queries, columns are keys.

    Parameters
    ----------
    weights : array_like, (Lq, Lk), (H, Lq, Lk) or (1, H, Lq, Lk)
        Attention weights, e.g. the second result of
        ``scaled_dot_product_attention(..., need_weights=True)`` or of
        ``MultiHeadAttention(..., need_weights=True)`` (take ``w[b]`` for a
        batch). Several heads are drawn as a grid of heatmaps sharing one
        colour bar. A PyTorch tensor works too, and so does a bool mask
        (True = may attend is drawn as 1), to picture a mask.
    query_tokens : sequence of str, optional
        Lq labels of the rows. Without tokens the axes show positions.
    key_tokens : sequence of str, optional
        Lk labels of the columns. Defaults to ``query_tokens`` when
        Lq == Lk (self-attention); give both for cross-attention.
    head : int or sequence of int, optional
        Heads to draw (negative counts from the end); default all.
    ax : matplotlib Axes, optional
        Draw a single heatmap into this Axes (and add its colour bar beside
        it); the weights must then select one head. Default: a new figure.
    cmap : str or Colormap
        The colour map (default ``"viridis"``).
    title : str, optional
        Title of the heatmap, or of the figure when there is a grid of heads.

    Returns
    -------
    fig : matplotlib.figure.Figure
        The figure holding the heatmap(s) and a colour bar (with ``ax``: the
        figure holding ``ax``). ``fig.savefig("attention.png")`` writes it.

    Raises
    ------
    ImportError
        matplotlib is not installed (the message says ``pip install "attnx[plot]"``).
    ValueError
        weights not (Lq, Lk), (H, Lq, Lk) or (1, H, Lq, Lk), or empty; tokens
        whose number differs from Lq or Lk; a head out of range; ``ax`` with
        several heads. The message names the shapes.
    TypeError
        weights not real numbers or bool; tokens given as one string; ``ax``
        not an Axes.

    Notes
    -----
    The colour scale runs from 0 to the largest weight shown (shared by all
    heads). Weights that are exactly 0 (masked keys, padded query rows,
    which attnx returns as rows of zeros) are drawn in light grey, so a
    mask's shape stays visible; NaN is drawn the same way. Negative values
    (scores rather than weights) are drawn on a plain min..max scale.

    matplotlib is optional: ``pip install "attnx[plot]"``. It is imported on
    the first call; on a machine without a display (and with no backend
    chosen) the Agg backend is used. The figure is made with pyplot, so a
    notebook shows it at the end of the cell; write ``fig = plot_attention(...)``
    (or end the line with ``;``) so that it is not shown twice.

    Examples
    --------
    >>> import numpy as np, attnx
    >>> tokens = "The animal didn't cross the street because it was too tired".split()
    >>> x = np.random.default_rng(0).standard_normal((len(tokens), 16), dtype=np.float32)
    >>> out, w = attnx.scaled_dot_product_attention(x, x, x, need_weights=True)  # w: (11, 11)
    >>> fig = attnx.plot_attention(w, tokens)                      # doctest: +SKIP
    >>> fig.savefig("attention.png")                               # doctest: +SKIP

    Several heads and cross-attention (3 target tokens attending to 4 source tokens):

    >>> w = np.full((2, 3, 4), 0.25)                               # (H, Lq, Lk)
    >>> fig = attnx.plot_attention(w, ["le", "chat", "dort"],
    ...                            ["the", "cat", "sleeps", "<pad>"])  # doctest: +SKIP
    """
    w, is_mask = _as_weights(weights)
    heads, names = _select_heads(w, head)
    Lq, Lk = heads[0].shape
    q_labels, k_labels = _labels(query_tokens, key_tokens, Lq, Lk, shape_str(w))
    if title is not None and not isinstance(title, str):
        raise TypeError(f"title must be a str; got {type(title).__name__}")
    if ax is not None and len(heads) != 1:
        raise ValueError(
            f"ax= draws one heatmap but weights of shape {shape_str(w)} give {len(heads)} heads; "
            f"choose one with head=")

    plt = _pyplot()
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    if ax is not None and not isinstance(ax, Axes):
        raise TypeError(f"ax must be a matplotlib Axes; got {type(ax).__name__}")
    vmin, vmax, nonneg = _color_range(heads)
    fig, axes = _figure(plt, ax, len(heads), Lq, Lk, q_labels, k_labels, title)
    images = _draw_heads(axes, heads, names, q_labels, k_labels, 1 if ax is not None else
                         _columns(len(heads)), plt.get_cmap(cmap).with_extremes(bad="#d9d9d9"),
                         vmin, vmax, nonneg)
    _titles_and_colorbar(fig, axes, images, names, title, is_mask, nonneg)
    root = fig
    while not isinstance(root, Figure):   # ax= in a SubFigure: return the figure holding it
        root = root.figure
    return root


def _labels(query_tokens: Optional[Sequence[str]], key_tokens: Optional[Sequence[str]], Lq: int,
            Lk: int, shape: str) -> Tuple[Optional[List[str]], Optional[List[str]]]:
    """Row and column labels; self-attention shares one list of tokens."""
    q_labels = _tokens(query_tokens, Lq, "query_tokens", "query rows", shape)
    k_labels = _tokens(key_tokens, Lk, "key_tokens", "key columns", shape)
    if k_labels is None and q_labels is not None and Lq == Lk:
        k_labels = q_labels
    if q_labels is None and k_labels is not None and Lq == Lk:
        q_labels = k_labels
    return q_labels, k_labels


def _color_range(heads: List[NDArray[np.float64]]) -> Tuple[float, float, bool]:
    """vmin, vmax, and whether the values are weights (non-negative: 0 drawn as masked)."""
    stack = np.stack(heads)
    finite = stack[np.isfinite(stack)]
    nonneg = bool(finite.size == 0 or finite.min() >= 0)
    if nonneg:
        return 0.0, float(finite.max()) if finite.size and finite.max() > 0 else 1.0, True
    return float(finite.min()), float(finite.max()), False


def _figure(plt: Any, ax: Optional["Axes"], n: int, Lq: int, Lk: int,
            q_labels: Optional[List[str]], k_labels: Optional[List[str]],
            title: Optional[str]) -> Tuple[Any, List[Any]]:
    """The figure and one axes a head: ``ax`` itself, or a grid sized to the tokens."""
    if ax is not None:
        return ax.figure, [ax]     # a Figure, or a SubFigure inside one
    ncols = _columns(n)
    nrows = math.ceil(n / ncols)
    longest_q = max((len(t) for t in q_labels), default=2) if q_labels else 2
    longest_k = max((len(t) for t in k_labels), default=2) if k_labels else 2
    side = 7.0 if n == 1 else 4.0                       # inches of the longest side of a heatmap
    cell = min(_CELL if n == 1 else 0.3, side / max(Lq, Lk))
    width = ncols * (Lk * cell + 0.09 * longest_q + 0.5) + 1.2
    height = nrows * (Lq * cell + 0.07 * longest_k + 0.7) + (0.4 if title else 0)
    fig, grid = plt.subplots(nrows, ncols, figsize=(width, height), squeeze=False,
                             layout="constrained")
    axes = list(grid.ravel())
    for extra in axes[n:]:
        fig.delaxes(extra)
    return fig, axes[:n]


def _draw_heads(axes: List[Any], heads: List[NDArray[np.float64]], names: List[Optional[str]],
                q_labels: Optional[List[str]], k_labels: Optional[List[str]], ncols: int,
                colors: Any, vmin: float, vmax: float, nonneg: bool) -> List[Any]:
    """One heatmap a head; a grid shares the token labels of its first column and last row."""
    n = len(heads)
    Lq, Lk = heads[0].shape
    aspect: Literal["equal", "auto"] = (
        "equal" if max(Lq, Lk) <= 4 * min(Lq, Lk) else "auto")   # square cells unless very thin
    images = []
    for i, (a, m, name) in enumerate(zip(axes, heads, names)):
        data = np.ma.masked_where(m == 0, m) if nonneg else m
        images.append(a.imshow(data, cmap=colors, vmin=vmin, vmax=vmax, aspect=aspect,
                               interpolation="nearest"))
        _set_ticks(a, "x", k_labels, Lk)
        _set_ticks(a, "y", q_labels, Lq)
        first_col = i % ncols == 0
        bottom = i + ncols >= n
        if not first_col:
            a.tick_params(labelleft=False)
        if not bottom:
            a.tick_params(labelbottom=False)
        if first_col:
            a.set_ylabel("query")
        if bottom:
            a.set_xlabel("key")
        if name is not None:
            a.set_title(name)
    return images


def _titles_and_colorbar(fig: Any, axes: List[Any], images: List[Any], names: List[Optional[str]],
                         title: Optional[str], is_mask: bool, nonneg: bool) -> None:
    if title is not None:
        if len(axes) == 1:
            axes[0].set_title(title if names[0] is None else f"{title} ({names[0]})")
        else:
            fig.suptitle(title)
    label = "mask (1 = may attend)" if is_mask else "weight" if nonneg else "value"
    if len(axes) == 1:
        # beside the heatmap as drawn (square cells shrink the axes box): as tall as the image
        cax = axes[0].inset_axes((1.04, 0.0, 0.05, 1.0), label="<colorbar>")  # as fig.colorbar names it
        cbar = fig.colorbar(images[-1], cax=cax, label=label)
    else:
        cbar = fig.colorbar(images[-1], ax=axes, label=label)
    if is_mask:
        cbar.set_ticks([0.0, 1.0])
