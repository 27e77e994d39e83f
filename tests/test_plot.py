"""attnx.plot_attention: figure structure, head grids, cross-attention, errors, optional matplotlib."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import attnx

TOKENS = "The animal didn't cross the street because it was too tired".split()


def _weights(*shape, seed=0):
    """Random attention weights (rows sum to 1), float32."""
    rng = np.random.default_rng(seed)
    w = rng.random(shape, dtype=np.float32) + 0.01
    return w / w.sum(axis=-1, keepdims=True)


# ------------------------------------------------ no matplotlib needed for these

def test_import_attnx_does_not_import_matplotlib():
    code = "import sys, attnx; assert 'matplotlib' not in sys.modules, 'imported eagerly'; print('ok')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


@pytest.mark.parametrize("blocked", ["matplotlib", "matplotlib.pyplot"])
def test_missing_matplotlib_says_what_to_install(monkeypatch, blocked):
    # None in sys.modules makes `import name` raise ImportError, as if not installed.
    monkeypatch.setitem(sys.modules, blocked, None)
    if blocked == "matplotlib":
        for name in [m for m in sys.modules if m.startswith("matplotlib.")]:
            monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ImportError, match=r'pip install "attnx\[plot\]"'):
        attnx.plot_attention(_weights(3, 3), ["a", "b", "c"])


def test_missing_matplotlib_in_a_fresh_interpreter():
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "import numpy as np, attnx\n"
            "try:\n"
            "    attnx.plot_attention(np.eye(2))\n"
            "except ImportError as e:\n"
            "    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert 'pip install "attnx[plot]"' in r.stdout


@pytest.mark.parametrize("bad, exc, match", [
    (np.zeros(5), ValueError, r"\(Lq, Lk\).*got shape \(5,\)"),
    (np.zeros((1, 1, 1, 2, 2)), ValueError, r"got shape \(1, 1, 1, 2, 2\)"),
    (np.full((2, 3, 4, 4), 0.25), ValueError, r"\(2, 3, 4, 4\) hold a batch of 2.*weights\[0\] of shape \(3, 4, 4\)"),
    (np.zeros((0, 4)), ValueError, r"\(0, 4\) are empty"),
    (np.zeros((2, 3, 0)), ValueError, r"\(2, 3, 0\) are empty"),
    (np.zeros((2, 2), dtype=complex), TypeError, r"complex128.*\(2, 2\)"),
    (np.array([["a", "b"]]), TypeError, r"dtype <U1"),
    ((np.zeros((2, 4)), np.zeros((2, 2))), TypeError, r"\(out, weights\).*second"),
])
def test_bad_weights(bad, exc, match):
    with pytest.raises(exc, match=match):
        attnx.plot_attention(bad)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(query_tokens=TOKENS[:3]), ValueError, r"query_tokens has 3 tokens but weights of shape \(2, 4\) have 2 query rows"),
    (dict(key_tokens=TOKENS[:3]), ValueError, r"key_tokens has 3 tokens but weights of shape \(2, 4\) have 4 key columns"),
    (dict(query_tokens="ab"), TypeError, r"not a string.*split"),
    (dict(key_tokens=5), TypeError, r"key_tokens must be a sequence"),
    (dict(head=0), ValueError, r"head=0.*\(2, 4\) have no head axis"),
    (dict(title=3), TypeError, r"title must be a str"),
])
def test_bad_arguments_2d(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        attnx.plot_attention(_weights(2, 4), **kwargs)


@pytest.mark.parametrize("head, exc, match", [
    (3, ValueError, r"head 3 is out of range for weights of shape \(3, 2, 2\) with 3 heads"),
    (-4, ValueError, r"head -4 is out of range"),
    ([0, 5], ValueError, r"head 5 is out of range"),
    ([], ValueError, r"empty"),
    (1.0, TypeError, r"head must be an int"),
    (True, TypeError, r"head must be an int"),
])
def test_bad_head(head, exc, match):
    with pytest.raises(exc, match=match):
        attnx.plot_attention(_weights(3, 2, 2), head=head)


# ------------------------------------------------------- these need matplotlib

@pytest.fixture
def plt():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    yield plt
    plt.close("all")


def _heatmaps(fig):
    return [a for a in fig.axes if a.images]


def _colorbars(fig):
    """The colour bars' axes (a single heatmap has its bar as a child axes, a grid one shared bar)."""
    bars = []
    for a in _heatmaps(fig):
        cb = a.images[0].colorbar
        if cb is not None and cb.ax not in bars:
            assert cb.ax in fig.axes or cb.ax in a.child_axes
            bars.append(cb.ax)
    return bars


def _labels(ticklabels):
    return [t.get_text() for t in ticklabels]


def test_self_attention_heatmap(plt):
    from matplotlib.figure import Figure

    x = np.random.default_rng(0).standard_normal((len(TOKENS), 16), dtype=np.float32)
    _, w = attnx.scaled_dot_product_attention(x, x, x, need_weights=True)   # (11, 11)
    fig = attnx.plot_attention(w, TOKENS)
    assert isinstance(fig, Figure)
    (ax,) = _heatmaps(fig)
    assert len(fig.axes) == 1 and len(_colorbars(fig)) == 1
    cbar = ax.images[0].colorbar
    assert cbar.ax in ax.child_axes                            # beside the heatmap, as tall as it
    assert cbar.ax.get_ylabel() == "weight"
    # rows = queries (y), columns = keys (x); key tokens default to the query tokens
    assert _labels(ax.get_yticklabels()) == TOKENS
    assert _labels(ax.get_xticklabels()) == TOKENS
    assert ax.get_ylabel() == "query" and ax.get_xlabel() == "key"
    data = ax.images[0].get_array()
    assert data.shape == (11, 11)
    np.testing.assert_array_equal(np.ma.getdata(data), w)
    assert not np.ma.getmaskarray(data).any()             # no zero weights here
    lo, hi = ax.images[0].get_clim()
    assert lo == 0 and hi == pytest.approx(float(w.max()))
    # the figure renders (Agg) without error
    fig.canvas.draw()


def test_cross_attention_shapes(plt):
    q_tokens, k_tokens = ["le", "chat", "dort"], ["the", "cat", "sleeps", "<pad>", "<pad>"]
    w = _weights(3, 5)
    fig = attnx.plot_attention(w, q_tokens, k_tokens, title="cross")
    (ax,) = _heatmaps(fig)
    assert ax.images[0].get_array().shape == (3, 5)
    assert _labels(ax.get_yticklabels()) == q_tokens
    assert _labels(ax.get_xticklabels()) == k_tokens
    assert ax.get_title() == "cross"
    # only query tokens for a non-square matrix: keys are shown as positions
    fig = attnx.plot_attention(w, q_tokens)
    (ax,) = _heatmaps(fig)
    assert _labels(ax.get_yticklabels()) == q_tokens
    assert ax.get_xticklabels() and all(t.get_text() != "le" for t in ax.get_xticklabels())


def test_no_tokens_show_positions(plt):
    fig = attnx.plot_attention(_weights(4, 6))
    (ax,) = _heatmaps(fig)
    fig.canvas.draw()
    shown = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
    assert shown and all(s.lstrip("−-").isdigit() for s in shown)


def test_head_grid(plt):
    w = _weights(1, 3, 4, 4)                                   # (B=1, H, Lq, Lk)
    toks = TOKENS[:4]
    fig = attnx.plot_attention(w, toks)
    axes = _heatmaps(fig)
    assert len(axes) == 3 and len(_colorbars(fig)) == 1 and len(fig.axes) == 4
    assert [a.get_title() for a in axes] == ["head 0", "head 1", "head 2"]
    for h, a in enumerate(axes):
        np.testing.assert_array_equal(np.ma.getdata(a.images[0].get_array()), w[0, h])
    # one colour scale shared by all heads
    assert [a.images[0].get_clim() for a in axes] == [(0.0, pytest.approx(float(w.max())))] * 3
    # the tokens label the first column (rows) and the bottom row (columns)
    assert _labels(axes[0].get_yticklabels()) == toks
    assert _labels(axes[0].get_xticklabels()) == toks


@pytest.mark.parametrize("H, rows_cols", [(2, (1, 2)), (4, (2, 2)), (8, (2, 4))])
def test_grid_layout(plt, H, rows_cols):
    fig = attnx.plot_attention(_weights(H, 3, 3))
    axes = _heatmaps(fig)
    assert len(axes) == H
    gs = axes[0].get_subplotspec().get_gridspec()
    assert (gs.nrows, gs.ncols) == rows_cols


def test_choose_heads(plt):
    w = _weights(4, 2, 3)
    fig = attnx.plot_attention(w, head=2)
    (ax,) = _heatmaps(fig)
    assert ax.get_title() == "head 2"
    np.testing.assert_array_equal(np.ma.getdata(ax.images[0].get_array()), w[2])
    fig = attnx.plot_attention(w, head=-1)
    (ax,) = _heatmaps(fig)
    assert ax.get_title() == "head 3"
    fig = attnx.plot_attention(w, head=[3, 0])
    axes = _heatmaps(fig)
    assert [a.get_title() for a in axes] == ["head 3", "head 0"]
    np.testing.assert_array_equal(np.ma.getdata(axes[0].images[0].get_array()), w[3])


def test_masked_weights_are_grey_not_dark(plt):
    # causal + padding, as attnx returns them: zeros above the diagonal and for padded rows
    L = 5
    x = np.random.default_rng(1).standard_normal((L, 8), dtype=np.float32)
    _, w = attnx.scaled_dot_product_attention(x[None], x[None], x[None], is_causal=True,
                                              key_lengths=[4], query_lengths=[4], need_weights=True)
    w = w[0]                                                    # (L, L)
    assert (w[4] == 0).all()
    fig = attnx.plot_attention(w, TOKENS[:L])
    im = _heatmaps(fig)[0].images[0]
    data = im.get_array()
    np.testing.assert_array_equal(np.ma.getmaskarray(data), w == 0)
    np.testing.assert_array_equal(np.ma.getdata(data), w)
    # masked cells get the colour map's "bad" colour, distinct from the colour of 0
    cmap = im.get_cmap()
    assert cmap.get_bad()[:3] != pytest.approx(cmap(0.0)[:3])
    rgba = im.to_rgba(data)
    assert np.allclose(rgba[4, 0], cmap.get_bad())               # padded query row
    assert np.allclose(rgba[0, 1], cmap.get_bad())               # above the diagonal
    assert not np.allclose(rgba[1, 0], cmap.get_bad())           # a real weight


def test_bool_mask_and_all_zero(plt):
    m = attnx.causal_mask(4)
    fig = attnx.plot_attention(m, TOKENS[:4])
    im = _heatmaps(fig)[0].images[0]
    np.testing.assert_array_equal(np.ma.getdata(im.get_array()), m.astype(float))
    assert im.get_clim() == (0.0, 1.0)
    fig = attnx.plot_attention(np.zeros((2, 3)))                # everything masked: no error
    assert _heatmaps(fig)[0].images[0].get_clim() == (0.0, 1.0)


def test_nested_sequences_and_mask_colorbar(plt):
    fig = attnx.plot_attention(((0.5, 0.5), (0.25, 0.75)))      # a 2x2 matrix as nested tuples
    assert _heatmaps(fig)[0].images[0].get_array().shape == (2, 2)
    assert _colorbars(fig)[0].get_ylabel() == "weight"
    fig = attnx.plot_attention(attnx.causal_mask(3))
    assert _colorbars(fig)[0].get_ylabel() == "mask (1 = may attend)"


def test_negative_values_use_min_max(plt):
    s = np.array([[-2.0, 0.0], [1.0, 3.0]])                     # scores, not weights
    fig = attnx.plot_attention(s)
    im = _heatmaps(fig)[0].images[0]
    assert im.get_clim() == (-2.0, 3.0)
    assert not np.ma.getmaskarray(im.get_array()).any()        # 0 is a real score here
    assert _colorbars(fig)[0].get_ylabel() == "value"


def test_into_existing_axes(plt):
    fig, (a1, a2) = plt.subplots(1, 2)
    w = _weights(2, 3, 3)
    out = attnx.plot_attention(w, TOKENS[:3], head=1, ax=a2)
    assert out is fig
    assert not a1.images and a2.images
    np.testing.assert_array_equal(np.ma.getdata(a2.images[0].get_array()), w[1])
    assert len(_colorbars(fig)) == 1
    with pytest.raises(ValueError, match=r"ax= draws one heatmap.*\(2, 3, 3\) give 2 heads"):
        attnx.plot_attention(w, ax=a1)
    with pytest.raises(TypeError, match="ax must be a matplotlib Axes"):
        attnx.plot_attention(w[0], ax="not an axes")


def test_into_a_subfigure_returns_the_figure(plt):
    fig = plt.figure(layout="constrained")
    left, right = fig.subfigures(1, 2)
    ax = right.subplots()
    assert attnx.plot_attention(_weights(3, 3), ax=ax) is fig
    assert ax.images and ax.images[0].colorbar is not None


def test_torch_tensor(plt):
    torch = pytest.importorskip("torch")
    w = torch.softmax(torch.randn(2, 3, 3, requires_grad=True), dim=-1)
    fig = attnx.plot_attention(w, TOKENS[:3])
    axes = _heatmaps(fig)
    assert len(axes) == 2
    np.testing.assert_allclose(np.ma.getdata(axes[1].images[0].get_array()), w[1].detach().numpy())


def test_agg_backend_when_headless(tmp_path):
    pytest.importorskip("matplotlib")
    code = ("import numpy as np, attnx, matplotlib\n"
            "fig = attnx.plot_attention(np.eye(3))\n"
            "print(matplotlib.get_backend().lower())\n")
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "MPLBACKEND")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "agg"
    # a backend the user chose is kept: in a matplotlibrc ...
    (tmp_path / "matplotlibrc").write_text("backend: svg\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(env, MATPLOTLIBRC=str(tmp_path)))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "svg"
    # ... or in MPLBACKEND (which Jupyter kernels set to their inline backend)
    env["MPLBACKEND"] = "pdf"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "pdf"


@pytest.mark.parametrize("shape, q_tokens, k_tokens", [
    ((11, 11), TOKENS, None),
    ((3, 11, 11), TOKENS, None),
    ((8, 4, 6), ["Ladies", "and", "gentlemen", "supercalifragilistic"], [f"key{i}" * 3 for i in range(6)]),
    ((1, 1), ["a-very-long-query-token"], ["a-very-long-key-token"]),
    ((150, 200), None, None),
])
def test_nothing_is_clipped(plt, shape, q_tokens, k_tokens):
    """Every label, tick label, title and the colour bar lie inside the figure, without overlaps."""
    fig = attnx.plot_attention(_weights(*shape), q_tokens, k_tokens, title="a title")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    box = fig.bbox.padded(3)                                    # pixels of slack for glyph edges
    texts = []
    for a in fig.axes + [cb for cb in _colorbars(fig) if cb not in fig.axes]:
        for axis in (a.xaxis, a.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            texts += [t.label1 for t in axis.get_major_ticks()          # the ticks that are drawn
                      if t.get_visible() and t.label1.get_visible() and lo - 1e-9 <= t.get_loc() <= hi + 1e-9]
            texts.append(axis.label)
        texts.append(a.title)
    texts.append(fig._suptitle) if fig._suptitle is not None else None
    for t in texts:
        if not t.get_text():
            continue
        ext = t.get_window_extent(renderer)
        assert box.contains(ext.x0, ext.y0) and box.contains(ext.x1, ext.y1), \
            f"{t.get_text()!r} at {ext} is outside the figure {fig.bbox}"
    # the heatmaps and the colour bars do not overlap each other
    boxes = [a.get_window_extent(renderer) for a in _heatmaps(fig)] + \
            [c.get_window_extent(renderer) for c in _colorbars(fig)]
    for i, b1 in enumerate(boxes):
        for b2 in boxes[i + 1:]:
            assert not b1.overlaps(b2.shrunk(0.98, 0.98)), (b1, b2)
