"""The attention variants (window, alignment, sinks, softcap, ALiBi) of
``attnx.torch.scaled_dot_product_attention`` against torch's own float32
computation of the same attention, forward and gradients:

* window and ALiBi as an explicit float mask given to
  ``torch.nn.functional.scaled_dot_product_attention``: -slope[h]·|d(i) - j|
  inside the band, -inf outside it, d(i) = i, or i + Lk - Lq aligned
  lower-right (by ``alignment=`` or ``is_causal="lower_right"``);
* sinks as one extra key column: a key of zeros whose mask entry is the sink
  logit (so its score is the sink) and whose value row is zero; the sinks'
  gradient is torch's gradient of that mask column;
* softcap in torch eager float32 math (``c * tanh(s / c)`` before the bias and
  the masks, then softmax), the one variant SDPA cannot express.

Both sides run in float32 with random upstream gradients (never ``out.sum()``),
odd sizes, both alignments, GQA (``enable_gqa``), ``layout="blhd"``, with and
without an ``attn_mask`` (bool or float, whose gradient is compared too),
lengths and per-batch sinks/slopes, on every ISA. Tolerances: PyTorch's own
float32 SDPA gradient tolerances with masks (atol 1.25e-5, rtol 5.25e-6,
as tests/test_grad.py), 1e-5 for outputs. Both the autograd path and the
no-grad path (inference) of ``attnx.torch`` are run.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import ATOL, GATOL, GRTOL, RTOL, randn

torch = pytest.importorskip("torch")
import attnx.torch as at  # noqa: E402

F = torch.nn.functional
INF = float("inf")


# --------------------------------------------------------- the torch side

def band(Lq, Lk, *, lower_right, window=None, causal=False):
    """(Lq, Lk) bool: key j allowed for query i; and d(i), the diagonal."""
    d = torch.arange(Lq)[:, None] + (Lk - Lq if lower_right else 0)
    j = torch.arange(Lk)[None, :]
    ok = torch.ones(Lq, Lk, dtype=torch.bool)
    if causal:
        ok &= j <= d
    if window is not None:
        left, right = (-1 if x is None else x for x in window)
        if left >= 0:
            ok &= j >= d - left
        if right >= 0:
            ok &= j <= d + right
    return ok, d


def variant_mask(B, Hq, Lq, Lk, c):
    """The float32 (B, Hq, Lq, Lk) additive mask expressing the window, the causal
    mask and ALiBi of case ``c``: -slope·|d(i) - j| inside, -inf outside."""
    causal = c.get("is_causal", False)
    lower_right = "lower_right" in (causal, c.get("alignment"))
    ok, d = band(Lq, Lk, lower_right=lower_right, window=c.get("window"), causal=bool(causal))
    bias = torch.zeros(B, Hq, Lq, Lk, dtype=torch.float64)
    if c.get("alibi_slopes") is not None:
        slopes = torch.tensor(np.asarray(c["alibi_slopes"], np.float64)).reshape(-1, Hq)
        dist = (d - torch.arange(Lk)[None, :]).abs().to(torch.float64)
        bias = bias - slopes[:, :, None, None] * dist        # slopes (1 or B, Hq)
    return bias.masked_fill(~ok, -INF).float()


def user_mask(m, B, Hq, Lq, Lk):
    """A user's attn_mask (bool or float, broadcastable) as a float additive mask."""
    if m is None:
        return torch.zeros(B, Hq, Lq, Lk)
    if m.dtype == torch.bool:
        return torch.zeros(B, Hq, Lq, Lk).masked_fill(~m, -INF)
    return m.expand(B, Hq, Lq, Lk)


def torch_attention(q, k, v, c, *, attn_mask=None, sinks=None):
    """torch's float32 attention of case ``c`` on tensors laid out as c["layout"]."""
    blhd = c.get("layout") == "blhd"
    if blhd:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    B, Hq, Lq, E = q.shape
    Hk, Lk, Ev = k.shape[1], k.shape[2], v.shape[3]
    add = variant_mask(B, Hq, Lq, Lk, c) + user_mask(attn_mask, B, Hq, Lq, Lk)
    if c.get("key_lengths") is not None:
        pad = torch.arange(Lk)[None, :] >= torch.tensor(c["key_lengths"])[:, None]     # (B, Lk)
        add = add.masked_fill(pad[:, None, None, :], -INF)
    if c.get("query_lengths") is not None:
        pad = torch.arange(Lq)[None, :] >= torch.tensor(c["query_lengths"])[:, None]   # (B, Lq)
        add = add.masked_fill(pad[:, None, :, None], -INF)
    if sinks is not None:      # an extra key: zeros, score = its mask entry = the sink, value zero
        k = torch.cat([k, k.new_zeros(B, Hk, 1, E)], 2)
        v = torch.cat([v, v.new_zeros(B, Hk, 1, Ev)], 2)
        add = torch.cat([add, sinks.reshape(-1, Hq, 1, 1).expand(B, Hq, Lq, 1)], 3)
    scale = c.get("scale")
    if c.get("softcap") is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=add, scale=scale,
                                             enable_gqa=c.get("enable_gqa", False))
    else:                       # torch eager math: the cap, then the bias and masks, softmax
        if Hq != Hk:
            k, v = (t.repeat_interleave(Hq // Hk, 1) for t in (k, v))
        cap = c["softcap"]
        s = q @ k.transpose(-1, -2) * (E ** -0.5 if scale is None else scale)
        s = cap * torch.tanh(s / cap)
        blocked = torch.isneginf(add.detach())
        s = (s + add.masked_fill(blocked, 0.0)).masked_fill(blocked, -INF)
        out = torch.softmax(s, -1).masked_fill(blocked.all(-1, keepdim=True), 0.0) @ v
    return out.transpose(1, 2) if blhd else out


# ----------------------------------------------------------------- running

def inputs(rng, c, Lq, Lk, *, B=2, Hq=3, Hk=None, E=12, Ev=10):
    Hk = Hq if Hk is None else Hk
    q, k, v = randn(rng, (B, Hq, Lq, E)), randn(rng, (B, Hk, Lk, E)), randn(rng, (B, Hk, Lk, Ev))
    if c.get("layout") == "blhd":
        q, k, v = (np.ascontiguousarray(a.swapaxes(1, 2)) for a in (q, k, v))
    return q, k, v


def run_both(rng, c, q, k, v, *, attn_mask=None, sinks=None):
    """Forward and a random-upstream-gradient backward, attnx.torch and torch;
    returns ``(ours, theirs)``: dicts of the output and every gradient."""
    results = []
    seed = int(rng.integers(2**32))                   # the same random upstream gradient for both
    for fn in (at.scaled_dot_product_attention, torch_attention):
        t = {n: torch.tensor(a, requires_grad=True) for n, a in (("query", q), ("key", k), ("value", v))}
        if sinks is not None:
            t["sinks"] = torch.tensor(np.asarray(sinks, np.float32), requires_grad=True)
        mask = None
        if attn_mask is not None:
            mask = torch.tensor(attn_mask, requires_grad=attn_mask.dtype != np.bool_)
            if mask.requires_grad:
                t["attn_mask"] = mask
        if fn is torch_attention:
            out = torch_attention(t["query"], t["key"], t["value"], c, attn_mask=mask,
                                  sinks=t.get("sinks"))
        else:
            out = fn(t["query"], t["key"], t["value"], attn_mask=mask, sinks=t.get("sinks"),
                     **c)
        dout = torch.tensor(randn(np.random.default_rng(seed), tuple(out.shape)))
        out.backward(dout)
        r = {"output": out.detach().numpy()}
        r.update({n: x.grad.numpy() for n, x in t.items()})
        results.append(r)
        if fn is at.scaled_dot_product_attention:     # the no-grad (inference) path: same bits
            with torch.no_grad():
                plain = fn(*(torch.tensor(a) for a in (q, k, v)), sinks=t.get("sinks"),
                           attn_mask=None if mask is None else mask.detach(), **c)
            assert not plain.requires_grad
            np.testing.assert_array_equal(plain.numpy(), r["output"], err_msg="no_grad output")
    return results


def assert_match(ours, theirs):
    assert ours.keys() == theirs.keys()
    np.testing.assert_allclose(ours["output"], theirs["output"], atol=ATOL, rtol=RTOL,
                               err_msg="output")
    assert np.isfinite(ours["output"]).all()
    for name in ours:
        if name != "output":
            assert ours[name].shape == theirs[name].shape, name
            np.testing.assert_allclose(ours[name], theirs[name], atol=GATOL, rtol=GRTOL,
                                       err_msg=f"gradient of {name}")


# ------------------------------------------------------------------- cases

SLOPES = np.array([0.5, 0.25, 0.0625], np.float32)
SINKS = np.array([0.3, -1.0, 2.5], np.float32)

CASES = {
    "window": dict(window=(5, 3)),
    "window_upper_left_explicit": dict(window=(2, 6), alignment="upper_left"),
    "window_lower_right": dict(window=(4, 2), alignment="lower_right"),
    "window_left_open_lower_right": dict(window=(None, 3), alignment="lower_right"),
    "window_right_open": dict(window=(3, -1)),
    "window_causal": dict(window=(6, 0), is_causal=True),
    "window_causal_lower_right": dict(window=(3, 0), is_causal="lower_right"),
    "alibi": dict(alibi_slopes=SLOPES),
    "alibi_lower_right": dict(alibi_slopes=SLOPES, alignment="lower_right"),
    "alibi_causal": dict(alibi_slopes=SLOPES, is_causal=True),
    "alibi_causal_lower_right": dict(alibi_slopes=SLOPES, is_causal="lower_right"),
    "alibi_window_lower_right": dict(alibi_slopes=SLOPES, window=(7, 2), alignment="lower_right"),
    "sinks": dict(sinks=SINKS),
    "sinks_window_causal_lower_right": dict(sinks=SINKS, window=(5, 0), is_causal="lower_right"),
    "sinks_alibi_window": dict(sinks=SINKS, alibi_slopes=SLOPES, window=(4, 4)),
    "softcap": dict(softcap=1.5),
    "softcap_causal": dict(softcap=2.0, is_causal=True),
    "softcap_alibi_lower_right": dict(softcap=3.0, alibi_slopes=SLOPES, alignment="lower_right"),
    "all_lower_right": dict(softcap=2.0, alibi_slopes=SLOPES, sinks=SINKS, window=(6, 1),
                            is_causal="lower_right"),
    "all_upper_left": dict(softcap=2.5, alibi_slopes=SLOPES, sinks=SINKS, window=(3, 5),
                           alignment="upper_left", scale=0.4),
}


def split(c):
    """(the case without its sinks, the sinks)."""
    return {n: x for n, x in c.items() if n != "sinks"}, c.get("sinks")


@pytest.mark.parametrize("Lq, Lk", [(19, 37), (23, 9)])     # more keys; more queries (empty rows)
@pytest.mark.parametrize("name", CASES)
def test_variant_matches_torch(rng, isa, name, Lq, Lk):
    c, sinks = split(CASES[name])
    q, k, v = inputs(rng, c, Lq, Lk)
    assert_match(*run_both(rng, c, q, k, v, sinks=sinks))


@pytest.mark.parametrize("name", ["window_causal_lower_right", "alibi_window_lower_right",
                                  "sinks_alibi_window", "all_lower_right"])
def test_variant_matches_torch_across_tiles(rng, isa, name):
    """Sizes past several tiles of the kernels (whole tiles outside the band skipped)."""
    c, sinks = split(CASES[name])
    c = {**c, "window": (40, 9)} if "window" in c else c
    q, k, v = inputs(rng, c, 131, 197, B=1, E=40, Ev=33)
    assert_match(*run_both(rng, c, q, k, v, sinks=sinks))


GQA_CASES = ["window_lower_right", "alibi_causal_lower_right", "sinks_window_causal_lower_right",
             "softcap_alibi_lower_right", "all_upper_left"]


@pytest.mark.parametrize("layout", ["bhld", "blhd"])
@pytest.mark.parametrize("name", GQA_CASES)
def test_variant_gqa_and_layout_match_torch(rng, isa, name, layout):
    """Six query heads over two key/value heads (torch: enable_gqa); per-query-head
    slopes and sinks; both layouts."""
    c, sinks = split(CASES[name])
    c = {**c, "enable_gqa": True, "layout": layout}
    if "alibi_slopes" in c:
        c["alibi_slopes"] = np.array([0.5, 0.25, 0.125, 0.0625, 1.0, 0.0], np.float32)
    if sinks is not None:
        sinks = np.array([0.3, -1.0, 2.5, 0.0, 1.0, -3.0], np.float32)
    q, k, v = inputs(rng, c, 17, 29, Hq=6, Hk=2)
    assert_match(*run_both(rng, c, q, k, v, sinks=sinks))


# ------------------------------------------------------- with an attn_mask

def float_mask(rng, shape, p_inf=0.2):
    m = randn(rng, shape)
    m[rng.random(shape) < p_inf] = -np.inf
    return m


MASKED = {
    # float mask (B, 1, Lq, Lk) with window, ALiBi and sinks: the mask's and the sinks' gradients
    "float_window_alibi_sinks": (dict(window=(5, 2), alibi_slopes=SLOPES, alignment="lower_right"),
                                 "float", (2, 1, 15, 26), SINKS),
    # float mask over (Lq, Lk), GQA, blhd, causal lower-right, every variant, per-batch sinks
    "float_gqa_blhd_all": (dict(window=(6, 0), alibi_slopes=np.array([[0.5, 0.25, 0.125, 0.0625, 1.0, 0.0],
                                                                       [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]],
                                                                      np.float32),
                                softcap=2.0, is_causal="lower_right", enable_gqa=True, layout="blhd"),
                           "float", (15, 26), np.array([[0.3, -1.0, 2.5, 0.0, 1.0, -3.0],
                                                        [1.0, 1.0, 1.0, -1.0, -1.0, -1.0]], np.float32)),
    # bool mask per head, softcap and a window, GQA
    "bool_gqa_softcap_window": (dict(window=(3, 3), softcap=1.5, enable_gqa=True), "bool",
                                (2, 6, 15, 26), None),
    # float mask per query row, blhd, sinks and ALiBi, key and query lengths
    "float_blhd_lengths_sinks": (dict(alibi_slopes=SLOPES, layout="blhd", key_lengths=[26, 11],
                                      query_lengths=[15, 8], alignment="lower_right"),
                                 "float", (2, 3, 15, 1), SINKS),
}


@pytest.mark.parametrize("name", MASKED)
def test_variants_with_an_attn_mask_match_torch(rng, isa, name):
    c, kind, shape, sinks = MASKED[name]
    Hq, Hk = (6, 2) if c.get("enable_gqa") else (3, 3)
    q, k, v = inputs(rng, c, 15, 26, Hq=Hq, Hk=Hk)
    if kind == "bool":
        m = rng.random(shape) < 0.7
    else:
        m = float_mask(rng, shape)
    ours, theirs = run_both(rng, c, q, k, v, attn_mask=m, sinks=sinks)
    assert ("attn_mask" in ours) == (kind == "float")
    assert_match(ours, theirs)
    if sinks is not None:
        assert ours["sinks"].shape == np.shape(sinks) and np.abs(ours["sinks"]).max() > 0


# ------------------------------------------------------------- need_weights

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad", [False, True])
def test_need_weights_returns_the_softmax_and_leaves_gradients_alone(rng, dtype, grad):
    """need_weights=True: (output, weights), the weights the exact softmax of torch's
    float32 scores (masks and sinks included) in the input's dtype; they are not
    differentiable, and the gradients through the output are those of the call
    without weights (a random upstream gradient)."""
    q, k, v = (torch.from_numpy(randn(rng, s)).to(dtype).requires_grad_(grad)
               for s in ((2, 4, 9, 16), (2, 2, 13, 16), (2, 2, 13, 16)))
    mask = torch.from_numpy(rng.random((2, 1, 9, 13)) > 0.3)
    sinks = torch.linspace(-1, 1, 4)
    out, w = at.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True,
                                             sinks=sinks, need_weights=True)
    assert w.shape == (2, 4, 9, 13) and w.dtype == dtype and out.dtype == dtype
    assert not w.requires_grad
    kk, vv = (x.detach().float().repeat_interleave(2, dim=1) for x in (k, v))
    s = q.detach().float() @ kk.transpose(-1, -2) / 4.0
    s = s.masked_fill(~mask, -INF)
    full = torch.cat([s, sinks[None, :, None, None].expand(2, 4, 9, 1)], dim=-1).softmax(-1)
    tol = 1e-6 if dtype == torch.float32 else 4e-3        # the weights rounded to bfloat16
    torch.testing.assert_close(w.float(), full[..., :-1], atol=tol, rtol=tol)
    plain = at.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, sinks=sinks)
    torch.testing.assert_close(out.float(), plain.float(), atol=1e-5 if dtype == torch.float32
                               else 1e-2, rtol=1e-5)
    if not grad:
        return
    dout = torch.from_numpy(randn(rng, out.shape)).to(dtype)
    g1 = torch.autograd.grad(out, (q, k, v), dout)
    g2 = torch.autograd.grad(plain, (q, k, v), dout)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-5 if dtype == torch.float32
                                   else 2e-2, rtol=1e-4)
    with pytest.raises(RuntimeError, match="does not require grad"):
        w.sum().backward()
