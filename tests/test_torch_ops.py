"""attnx as PyTorch operators (issue 59): ``torch.ops.attnx.scaled_dot_product_attention``
and ``..._backward``, what ``attnx.torch.scaled_dot_product_attention`` calls
under ``torch.compile`` and ``torch.export``.

* ``torch.library.opcheck`` on both operators, over inputs that cover every
  option (masks bool/float/BlockMask, sinks, lengths, ALiBi, window, softcap,
  both alignments, both layouts, GQA, Ev != E, 2-D and 3-D inputs, weights,
  lse or not, float64/bfloat16 inputs, precision="medium").
* ``torch.compile(fullgraph=True)`` (backend "aot_eager": AOTAutograd traces
  the forward and the backward through the fake implementations, as inductor
  does, without generating code) with no graph break (``torch._dynamo.explain``),
  the same outputs and gradients as eager for random upstream gradients;
  sequence lengths that change without a recompile each; a transformers Llama
  (random weights from a config, nothing downloaded) with
  ``attn_implementation="attnx"`` and ``model.forward`` compiled.
* ``torch.export.export``: an ExportedProgram holding the operator that runs
  and matches eager, at other lengths too (a dynamic dimension).
* FlexAttention's ``BlockMask`` as ``attn_mask``: the result of
  ``flex_attention`` itself with that BlockMask (float64, forward and
  gradients) and of the dense mask it stands for, its mask_mod evaluated once
  (kept on the object), partial/full/empty blocks, a mask_mod of b and h.
* The eager path: errors as before (the same messages with and without a
  gradient), out and lse saved once.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import attnx  # noqa: E402
import attnx.torch as at  # noqa: E402
from attnx import _torch_ops as ops  # noqa: E402

flex = pytest.importorskip("torch.nn.attention.flex_attention")
F = torch.nn.functional

# what opcheck runs (its default list)
CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor",
          "test_aot_dispatch_dynamic")


def randn(*shape, dtype=torch.float32, grad=True, seed=None):
    g = torch.Generator().manual_seed(seed if seed is not None else hash(shape) % 1000)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_(grad)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# ---------------------------------------------------------------------- the operators

DEFAULT_OPTIONS = dict(dropout_p=0.0, is_causal=0, scale=None, enable_gqa=False, layout="bhld",
                       window=None, softcap=None, alignment=None, precision="highest")


def op_args(q, k, v, attn_mask=None, mask_blocks=None, sinks=None, key_lengths=None,
            query_lengths=None, alibi_slopes=None, need_weights=False, need_lse=True, **options):
    """The forward operator's positional arguments (its schema's order)."""
    o = dict(DEFAULT_OPTIONS, **options)
    return (q, k, v, attn_mask, mask_blocks, sinks, key_lengths, query_lengths, alibi_slopes,
            *(o[n] for n in DEFAULT_OPTIONS), need_weights, need_lse)


def _prefix_lm():
    bm = attnx.BlockMask.prefix_lm(70, 20)
    return ops.block_mask_tensors(bm)


CASES = {
    "plain_causal": lambda: dict(q=randn(1, 2, 9, 8), k=randn(1, 2, 9, 8), v=randn(1, 2, 9, 8),
                                 is_causal=1),
    "gqa_ev_blhd_weights": lambda: dict(
        q=randn(2, 7, 4, 16), k=randn(2, 11, 2, 16), v=randn(2, 11, 2, 8), enable_gqa=True,
        layout="blhd", need_weights=True, scale=0.3),
    "float_mask_sinks_lengths": lambda: dict(
        q=randn(2, 4, 6, 8), k=randn(2, 4, 10, 8), v=randn(2, 4, 10, 8),
        attn_mask=randn(6, 10), sinks=randn(4), key_lengths=torch.tensor([10, 7]),
        query_lengths=torch.tensor([6, 4]), need_weights=True),
    "bool_mask_window_softcap_lower_right": lambda: dict(
        q=randn(1, 2, 5, 8), k=randn(1, 2, 12, 8), v=randn(1, 2, 12, 8),
        attn_mask=torch.rand(1, 1, 5, 12, generator=torch.Generator().manual_seed(0)) > 0.2,
        window=[4, -1], softcap=3.0, is_causal=2),
    "alibi_alignment_per_batch_sinks": lambda: dict(
        q=randn(2, 3, 7, 8), k=randn(2, 3, 9, 8), v=randn(2, 3, 9, 4),
        alibi_slopes=torch.tensor([0.5, 0.25, 0.125]), alignment="lower_right",
        sinks=randn(2, 3), window=[2, 3]),
    "block_mask": lambda: dict(q=randn(1, 2, 70, 8), k=randn(1, 2, 70, 8), v=randn(1, 2, 70, 8),
                               **dict(zip(("attn_mask", "mask_blocks"), _prefix_lm()))),
    "three_d_float64": lambda: dict(q=randn(3, 5, 8, dtype=torch.float64),
                                    k=randn(3, 6, 8, dtype=torch.float64),
                                    v=randn(3, 6, 8, dtype=torch.float64)),
    "two_d_no_lse": lambda: dict(q=randn(5, 8, grad=False), k=randn(6, 8, grad=False),
                                 v=randn(6, 4, grad=False), need_lse=False, need_weights=True),
    "bfloat16_medium": lambda: dict(q=randn(1, 2, 6, 8, dtype=torch.bfloat16),
                                    k=randn(1, 2, 6, 8, dtype=torch.bfloat16),
                                    v=randn(1, 2, 6, 8, dtype=torch.bfloat16),
                                    precision="medium", is_causal=1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_opcheck_forward(case):
    args = op_args(**CASES[case]())
    result = torch.library.opcheck(ops.forward, args, test_utils=CHECKS)
    assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("case", ["gqa_ev_blhd_weights", "float_mask_sinks_lengths",
                                  "bool_mask_window_softcap_lower_right",
                                  "alibi_alignment_per_batch_sinks", "block_mask",
                                  "three_d_float64"])
def test_opcheck_backward(case):
    c = CASES[case]()
    c["need_weights"] = False
    fargs = op_args(**c)
    with torch.no_grad():
        out, lse, _ = ops.forward(*fargs)
    dout = randn(*out.shape, grad=False, seed=1)
    mask = c.get("attn_mask")
    mask_grad = mask is not None and mask.dtype != torch.bool
    detached = [t.detach() if isinstance(t, torch.Tensor) else t for t in fargs]
    args = (dout, *detached[:3], out, lse, *detached[3:9], *detached[9:18], mask_grad)
    result = torch.library.opcheck(ops.backward, args, test_utils=CHECKS)
    assert set(result.values()) == {"SUCCESS"}, result
    # and its gradients are attnx's NumPy backward's
    g = ops.backward(*args)
    want = attnx.scaled_dot_product_attention_backward(
        dout.numpy(), *(t.detach().float().numpy() for t in fargs[:3]), out.numpy(), lse.numpy(),
        **numpy_kwargs(c))
    for got, w in zip(g[:3], want[:3]):
        np.testing.assert_array_equal(got.numpy(), w)


def numpy_kwargs(c):
    """A case's options as attnx's NumPy functions take them."""
    kw = {n: c[n] for n in ("enable_gqa", "layout", "softcap", "alignment", "scale", "precision")
          if n in c}
    kw["is_causal"] = {0: False, 1: True, 2: "lower_right"}[c.get("is_causal", 0)]
    if "window" in c:
        kw["window"] = tuple(c["window"])
    for n in ("attn_mask", "sinks", "key_lengths", "query_lengths", "alibi_slopes"):
        if c.get(n) is not None:
            kw[n] = c[n].detach().numpy()
    if c.get("mask_blocks") is not None:
        kw["attn_mask"] = ops._mask_arg(c["attn_mask"], c["mask_blocks"])
    return kw


def test_operators_are_registered_with_their_schemas():
    fwd = torch.ops.attnx.scaled_dot_product_attention.default
    bwd = torch.ops.attnx.scaled_dot_product_attention_backward.default
    names = [a.name for a in fwd._schema.arguments]
    assert names[:9] == ["query", "key", "value", "attn_mask", "mask_blocks", "sinks",
                         "key_lengths", "query_lengths", "alibi_slopes"]
    assert names[9:] == list(DEFAULT_OPTIONS) + ["need_weights", "need_lse"]
    assert len(fwd._schema.returns) == 3 and len(bwd._schema.returns) == 5
    assert not any(a.alias_info for a in fwd._schema.arguments)      # mutates nothing


def test_operator_gradients_match_the_eager_path():
    """The operator's registered autograd (what compile and export trace) and
    attnx.torch's eager path give the same bits, mask and sinks included."""
    c = CASES["float_mask_sinks_lengths"]()
    c["need_weights"] = False
    args = op_args(**c)
    out_op = ops._forward_op(*args)[0]             # the CustomOpDef: its autograd
    dout = randn(*out_op.shape, grad=False, seed=3)
    inputs = [c["q"], c["k"], c["v"], c["attn_mask"], c["sinks"]]
    g_op = torch.autograd.grad(out_op, inputs, dout)
    out = at.scaled_dot_product_attention(
        c["q"], c["k"], c["v"], attn_mask=c["attn_mask"], sinks=c["sinks"],
        key_lengths=c["key_lengths"], query_lengths=c["query_lengths"])
    g = torch.autograd.grad(out, inputs, dout)
    torch.testing.assert_close(out_op, out, rtol=0, atol=0)
    for a, b in zip(g_op, g):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_gradients_go_only_where_asked():
    """Each input's gradient from its own need (the sinks' without the query's)."""
    q, k, v = randn(1, 2, 5, 8, grad=False), randn(1, 2, 5, 8, grad=False), randn(1, 2, 5, 8)
    s = randn(2)
    out = at.scaled_dot_product_attention(q, k, v, sinks=s)
    out.backward(randn(*out.shape, grad=False, seed=2))
    q2, k2, v2, s2 = (t.detach().requires_grad_() for t in (q, k, v, s))
    out_all = at.scaled_dot_product_attention(q2, k2, v2, sinks=s2)
    g_all = torch.autograd.grad(out_all, (v2, s2), randn(*out.shape, grad=False, seed=2))
    assert s.grad is not None and v.grad is not None and q.grad is None and k.grad is None
    torch.testing.assert_close(v.grad, g_all[0], rtol=0, atol=0)
    torch.testing.assert_close(s.grad, g_all[1], rtol=0, atol=0)


# ---------------------------------------------------------------------- torch.compile

def compiled_vs_eager(f, *args, grad_inputs=(), explain=True):
    """f compiled (fullgraph, aot_eager) against f eager: no graph break (also
    by torch._dynamo.explain), the same outputs, the same gradients of
    ``grad_inputs`` for a random upstream gradient (within float32 rounding)."""
    explained = None
    if explain:
        explained = torch._dynamo.explain(f)(*args)
        assert explained.graph_break_count == 0, explained.break_reasons
        assert explained.graph_count == 1
        torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True, backend="aot_eager")
    got, want = cf(*args), f(*args)
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    if grad_inputs:
        dout = randn(*want[0].shape, grad=False, seed=7, dtype=want[0].dtype)
        g_got = torch.autograd.grad(got[0], grad_inputs, dout)
        g_want = torch.autograd.grad(want[0], grad_inputs, dout)
        for a, b in zip(g_got, g_want):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    return explained


def test_compile_fullgraph_options():
    """Every option traced without a graph break, forward and backward."""
    q, k, v = randn(2, 4, 10, 16), randn(2, 2, 12, 16), randn(2, 2, 12, 8)
    m, s = randn(10, 12), randn(4)

    def f(q, k, v, m, s):
        return at.scaled_dot_product_attention(
            q, k, v, attn_mask=m, enable_gqa=True, sinks=s, window=(5, 0), softcap=8.0,
            is_causal="lower_right", key_lengths=[12, 9], alibi_slopes=[0.1, 0.2, 0.3, 0.4])
    explained = compiled_vs_eager(f, q, k, v, m, s, grad_inputs=(q, k, v, m, s))
    # one attnx node, no Python state (threads) read in the graph
    ops_called = [n.target for g in explained.graphs for n in g.graph.nodes
                  if n.op == "call_function"]
    assert ops_called.count(torch.ops.attnx.scaled_dot_product_attention.default) == 1


@pytest.mark.parametrize("layout", ["bhld", "blhd"])
def test_compile_fullgraph_layouts_weights_bfloat16(layout):
    shape = (1, 3, 9, 8) if layout == "bhld" else (1, 9, 3, 8)
    q, k, v = (randn(*shape, dtype=torch.bfloat16, seed=i) for i in range(3))
    mask = torch.rand(9, 9, generator=torch.Generator().manual_seed(1)) > 0.3

    def f(q, k, v):
        return at.scaled_dot_product_attention(q, k, v, attn_mask=mask, layout=layout,
                                               need_weights=True)
    compiled_vs_eager(f, q, k, v, grad_inputs=(q, k, v))
    out, w = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    assert out.dtype == w.dtype == torch.bfloat16 and not w.requires_grad


def test_compile_without_grad_and_under_no_grad():
    q = randn(1, 2, 8, 8, grad=False)

    def f(q):
        return at.scaled_dot_product_attention(q, q, q, is_causal=True)
    compiled_vs_eager(f, q)
    with torch.no_grad():
        x = randn(1, 2, 8, 8)
        compiled_vs_eager(f, x)


def test_compile_dynamic_lengths_do_not_recompile():
    from torch._dynamo.testing import CompileCounterWithBackend

    def f(q, k, v, m):
        return at.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True,
                                               layout="blhd")
    cc = CompileCounterWithBackend("aot_eager")
    cf = torch.compile(f, fullgraph=True, backend=cc)
    counts = []
    for L in (5, 9, 17, 30, 41):
        q, k, v = randn(2, L, 4, 8, seed=L), randn(2, L, 2, 8, seed=L + 1), randn(2, L, 2, 8)
        m = randn(L, L, seed=L + 2)
        out = cf(q, k, v, m)
        dout = randn(*out.shape, grad=False, seed=L + 3)
        got = torch.autograd.grad(out, (q, k, v, m), dout)
        want = torch.autograd.grad(f(q, k, v, m), (q, k, v, m), dout)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        counts.append(cc.frame_count)
    # the first length, then one dynamic recompile, then none
    assert counts[2:] == [counts[1]] * 3, counts


def test_compile_errors_come_from_attnx_at_run_time():
    """Under compile the fake implementation only gives shapes: bad arguments are
    attnx's own errors, raised by the operator when it runs."""
    def f(q, k, v):
        return at.scaled_dot_product_attention(q, k, v)
    cf = torch.compile(f, fullgraph=True, backend="aot_eager")
    with pytest.raises(ValueError, match="query has 4 heads but key/value have 2"):
        cf(randn(1, 4, 5, 8), randn(1, 2, 5, 8), randn(1, 2, 5, 8))


def test_fake_tensors_and_make_fx_take_the_operator():
    """A tracer's tensors outside torch.compile (FakeTensorMode, make_fx) get the
    operator too: shapes from its fake implementation, a graph that runs."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    with FakeTensorMode():
        q, kv = torch.empty(2, 9, 6, 16), torch.empty(2, 11, 3, 8)
        out, w = at.scaled_dot_product_attention(q, torch.empty(2, 11, 3, 16), kv,
                                                 enable_gqa=True, layout="blhd",
                                                 need_weights=True)
        assert out.shape == (2, 9, 6, 8) and w.shape == (2, 6, 9, 11)

    def f(q, k, v):
        return at.scaled_dot_product_attention(q, k, v, is_causal=True)
    q, k, v = (randn(1, 2, 7, 8, grad=False, seed=i) for i in range(3))
    gm = make_fx(f, tracing_mode="fake")(q, k, v)
    assert any(n.target is torch.ops.attnx.scaled_dot_product_attention.default
               for n in gm.graph.nodes)
    torch.testing.assert_close(gm(q, k, v), f(q, k, v), rtol=0, atol=0)


# ---------------------------------------------------------------------- torch.export

class _Block(torch.nn.Module):
    """Projections, attnx attention (GQA, blhd, causal), output projection."""

    def __init__(self, attn_mask=None):
        super().__init__()
        torch.manual_seed(0)
        self.qkv = torch.nn.Linear(16, 32)
        self.out = torch.nn.Linear(16, 16)
        self.attn_mask = attn_mask

    def forward(self, x):
        B, L, _ = x.shape
        h = self.qkv(x)
        q = h[..., :16].view(B, L, 4, 4)
        k, v = h[..., 16:24].view(B, L, 2, 4), h[..., 24:].view(B, L, 2, 4)
        y = at.scaled_dot_product_attention(q, k, v, attn_mask=self.attn_mask,
                                            is_causal=self.attn_mask is None, enable_gqa=True,
                                            layout="blhd")
        return self.out(y.reshape(B, L, 16))


def test_export_runs_and_matches_eager_at_other_lengths():
    m = _Block()
    x = randn(2, 10, 16, grad=False)
    ep = torch.export.export(m, (x,), dynamic_shapes={"x": {1: torch.export.Dim("L", min=2,
                                                                              max=128)}})
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert torch.ops.attnx.scaled_dot_product_attention.default in targets
    for L in (10, 3, 37):
        x = randn(2, L, 16, grad=False, seed=L)
        torch.testing.assert_close(ep.module()(x), m(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["attnx", "flex"])
def test_export_with_block_masks(kind):
    L = 40
    if kind == "attnx":
        mask = attnx.BlockMask.prefix_lm(L, 8)
    else:
        mask = flex.create_block_mask(lambda b, h, q, k: k <= q, None, None, L, L, device="cpu",
                                      BLOCK_SIZE=16)
    m = _Block(mask)
    x = randn(1, L, 16, grad=False)
    ep = torch.export.export(m, (x,))
    torch.testing.assert_close(ep.module()(x), m(x), rtol=1e-6, atol=1e-6)
    with torch.no_grad():              # the eager calls after the export still read real memory
        torch.testing.assert_close(m(x), ep.module()(x), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------- transformers

def test_transformers_llama_compiled_fullgraph():
    transformers = pytest.importorskip("transformers")
    import attnx.integrations.transformers as hf
    from torch._dynamo.testing import CompileCounterWithBackend
    hf.register()
    config = transformers.LlamaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=48)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(copy.deepcopy(config))
    model.set_attn_implementation("attnx")
    model.train()                         # gradients through the compiled forward

    def run(forward, L):
        g = torch.Generator().manual_seed(L)
        ids = torch.randint(0, 100, (2, L), generator=g)
        mask = torch.ones(2, L, dtype=torch.long)
        mask[1, :3] = 0                   # left padding: a 4-D mask reaches attnx
        logits = forward(input_ids=ids, attention_mask=mask, use_cache=False).logits
        dout = torch.randn(logits.shape, generator=g)
        params = [p for _, p in model.named_parameters()]
        return logits, torch.autograd.grad(logits, params, dout)

    # fullgraph=True: the whole forward (and AOTAutograd's backward) in one graph, no break
    cc = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model.forward, fullgraph=True, backend=cc)
    counts = []
    for L in (9, 13, 21):
        got, g_got = run(compiled, L)
        want, g_want = run(model.forward, L)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for a, b in zip(g_got, g_want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        counts.append(cc.frame_count)
    assert counts[-1] == counts[1], counts       # no recompile per length


# ---------------------------------------------------------------------- FlexAttention's BlockMask

DOC = torch.tensor([0] * 32 + [1] * 37 + [2] * 11)      # three packed documents, L = 80


def doc_causal(b, h, q, k):
    return (DOC[q] == DOC[k]) & (k <= q)


def by_head_and_batch(b, h, q, k):
    """Head 0 causal, head 1 a window of 9, batch 1 also its first 5 keys."""
    return ((k <= q) & ((h == 0) | (q - k < 9))) | ((b == 1) & (k < 5))


def flex64(q, k, v, bm):
    """flex_attention itself, float64 eager (it has no backward on CPU)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")           # "called without torch.compile()"
        return flex.flex_attention(*(x.detach().double() for x in (q, k, v)), block_mask=bm,
                                   enable_gqa=q.shape[1] != k.shape[1])


def sdpa64(q, k, v, dense, dout):
    """torch's SDPA in float64 with a dense bool mask: output and gradients."""
    t = [x.detach().double().requires_grad_() for x in (q, k, v)]
    out = F.scaled_dot_product_attention(*t, attn_mask=dense, enable_gqa=q.shape[1] != k.shape[1])
    return out, torch.autograd.grad(out, t, dout.double())


@pytest.mark.parametrize("case", ["doc_causal", "by_head_and_batch", "gqa_blhd", "noop_lengths"])
def test_flex_block_mask_is_flex_attentions_mask(case):
    B, H, L, E = 2, 2, 80, 8
    mask_mod, Hk, layout, Lk = {"doc_causal": (doc_causal, 2, "bhld", 80),
                                "by_head_and_batch": (by_head_and_batch, 2, "bhld", 80),
                                "gqa_blhd": (doc_causal, 1, "blhd", 80),
                                "noop_lengths": (flex.noop_mask, 2, "bhld", 57)}[case]
    bsz = B if case == "by_head_and_batch" else None
    hsz = H if case == "by_head_and_batch" else None
    bm = flex.create_block_mask(mask_mod, bsz, hsz, L, Lk, device="cpu", BLOCK_SIZE=16)
    if case == "doc_causal":       # blocks of all three kinds
        dense_blocks = bm.to_dense()
        assert bm.full_kv_num_blocks.sum() > 0 and (dense_blocks == 0).any()
    q, k, v = randn(B, H, L, E, seed=1), randn(B, Hk, Lk, E, seed=2), randn(B, Hk, Lk, E, seed=3)
    dout = randn(B, H, L, E, grad=False, seed=4)
    dense = flex.create_mask(mask_mod, bsz, hsz, L, Lk, device="cpu")
    want, g_want = sdpa64(q, k, v, dense, dout)
    torch.testing.assert_close(flex64(q, k, v, bm), want)        # what it stands for

    def ours(x):
        return x.transpose(1, 2) if layout == "blhd" else x
    out = ours(at.scaled_dot_product_attention(ours(q), ours(k), ours(v), attn_mask=bm,
                                               enable_gqa=Hk != H, layout=layout))
    g = torch.autograd.grad(out, (q, k, v), dout)
    torch.testing.assert_close(out.double(), want, rtol=5e-6, atol=1e-5)
    for a, b in zip(g, g_want):
        torch.testing.assert_close(a.double(), b, rtol=5.25e-6, atol=1.25e-5)
    # the dense mask it stands for gives the same bits
    out_d = ours(at.scaled_dot_product_attention(ours(q), ours(k), ours(v), attn_mask=dense,
                                                 enable_gqa=Hk != H, layout=layout))
    torch.testing.assert_close(out, out_d, rtol=0, atol=0)
    for a, b in zip(g, torch.autograd.grad(out_d, (q, k, v), dout)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with torch.no_grad():           # inference: the same mask
        torch.testing.assert_close(ours(at.scaled_dot_product_attention(
            ours(q), ours(k), ours(v), attn_mask=bm, enable_gqa=Hk != H, layout=layout)), out)


@pytest.mark.filterwarnings("ignore:.*torch.jit.script_method:DeprecationWarning")
def test_flex_full_blocks_are_not_masked():
    """A block listed as full is attended whole (flex_attention skips the
    mask_mod there), one listed in neither list is skipped, whatever mask_mod says."""
    L, BS = 48, 16
    num = torch.tensor([[[1, 1, 1]]], dtype=torch.int32)                         # (B, H, nq)
    idx = torch.tensor([[[[0, 1, 2], [1, 0, 2], [2, 0, 1]]]], dtype=torch.int32)  # diagonal: partial
    full_num = torch.tensor([[[0, 1, 0]]], dtype=torch.int32)
    full_idx = torch.tensor([[[[0, 0, 0], [2, 0, 0], [0, 0, 0]]]], dtype=torch.int32)  # above it
    bm = flex.BlockMask.from_kv_blocks(num, idx, full_num, full_idx, BLOCK_SIZE=BS,
                                       mask_mod=lambda b, h, q, k: k <= q)
    dense = torch.zeros(L, L, dtype=torch.bool)
    for r in range(3):
        dense[r * BS:(r + 1) * BS, r * BS:(r + 1) * BS] = torch.ones(BS, BS).tril() > 0
    dense[BS:2 * BS, 2 * BS:] = True
    q, k, v = randn(1, 1, L, 8, seed=5), randn(1, 1, L, 8, seed=6), randn(1, 1, L, 8, seed=7)
    dout = randn(1, 1, L, 8, grad=False, seed=8)
    want, g_want = sdpa64(q, k, v, dense, dout)
    out = at.scaled_dot_product_attention(q, k, v, attn_mask=bm)
    g = torch.autograd.grad(out, (q, k, v), dout)
    torch.testing.assert_close(out.double(), want, rtol=5e-6, atol=1e-5)
    for a, b in zip(g, g_want):
        torch.testing.assert_close(a.double(), b, rtol=5.25e-6, atol=1.25e-5)
    assert torch.equal(ops.flex_dense(bm)[0, 0], dense)
    # flex_attention's compiled kernel reads the blocks so (its eager fallback reads
    # only the mask_mod, everywhere: it differs from its own kernel here)
    try:
        kernel = torch.compile(flex.flex_attention)(q.detach(), k.detach(), v.detach(),
                                                    block_mask=bm)
    except Exception as e:                     # no C++ compiler for inductor
        pytest.skip(f"flex_attention does not compile here: {type(e).__name__}")
    torch.testing.assert_close(out.detach(), kernel, rtol=5e-6, atol=1e-5)


def test_flex_mask_mod_is_evaluated_once_and_kept():
    calls = []

    def counted(b, h, q, k):
        calls.append(1)
        return k <= q
    bm = flex.create_block_mask(counted, None, None, 20, 20, device="cpu")
    calls.clear()
    q = randn(1, 2, 20, 8)
    for _ in range(3):                       # layers, steps: with and without a gradient
        at.scaled_dot_product_attention(q, q, q, attn_mask=bm).sum().backward()
        with torch.no_grad():
            at.scaled_dot_product_attention(q, q, q, attn_mask=bm)
    assert len(calls) == 1                   # one (vmapped) evaluation
    kept = ops.from_flex(bm)
    assert isinstance(kept, attnx.BlockMask) and kept is ops.from_flex(bm)
    assert np.array_equal(kept.mask[0, 0], np.tri(20, dtype=bool))


def test_flex_block_mask_under_compile():
    L = 40
    bm = flex.create_block_mask(doc_causal, None, None, L, L, device="cpu", BLOCK_SIZE=16)
    q, k, v = randn(1, 2, L, 8, seed=1), randn(1, 2, L, 8, seed=2), randn(1, 2, L, 8, seed=3)

    def given(q, k, v):                    # evaluated before (eager), read as graph inputs
        return at.scaled_dot_product_attention(q, k, v, attn_mask=bm)

    def made_inside(q, k, v):              # created and evaluated in the graph
        inner = flex.create_block_mask(doc_causal, None, None, L, L, device="cpu",
                                       BLOCK_SIZE=16)
        return at.scaled_dot_product_attention(q, k, v, attn_mask=inner)
    compiled_vs_eager(given, q, k, v, grad_inputs=(q, k, v))
    compiled_vs_eager(made_inside, q, k, v, grad_inputs=(q, k, v), explain=False)
    dense = flex.create_mask(doc_causal, None, None, L, L, device="cpu")
    torch.testing.assert_close(torch.compile(made_inside, fullgraph=True, backend="aot_eager")(
        q, k, v), at.scaled_dot_product_attention(q, k, v, attn_mask=dense), rtol=0, atol=0)


def test_attnx_block_mask_under_compile():
    bm = attnx.BlockMask.documents([20, 30, 14], causal=True)
    q, k, v = randn(1, 2, 64, 8, seed=1), randn(1, 2, 64, 8, seed=2), randn(1, 2, 64, 8, seed=3)

    def f(q, k, v):
        return at.scaled_dot_product_attention(q, k, v, attn_mask=bm)
    compiled_vs_eager(f, q, k, v, grad_inputs=(q, k, v))


def test_attnx_block_mask_without_tensors_under_compile():
    """A BlockMask built before attnx.torch was imported has no tensors for a
    graph: compiling says so; one eager call gives it them."""
    bm = attnx.BlockMask.prefix_lm(16, 4)
    del bm.__dict__["_torch"]                     # as if built before `import attnx.torch`
    q = randn(1, 2, 16, 8)

    def f(q):
        return at.scaled_dot_product_attention(q, q, q, attn_mask=bm)
    with pytest.raises(Exception, match="built before attnx.torch was imported"):
        torch.compile(f, fullgraph=True, backend="aot_eager")(q)
    want = f(q)                                   # eager: its tensors made and kept
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="aot_eager")(q), want)


def test_flex_block_mask_of_other_lengths_is_refused():
    bm = flex.create_block_mask(lambda b, h, q, k: k <= q, None, None, 32, 32, device="cpu")
    q = randn(1, 2, 20, 8)
    with pytest.raises(ValueError, match=r"created for \(Q_LEN, KV_LEN\) = \(32, 32\) but query "
                                         r"has Lq=20 and key Lk=20"):
        at.scaled_dot_product_attention(q, q, q, attn_mask=bm)


# ---------------------------------------------------------------------- the eager path

BAD = {
    "scale": dict(scale="big"),
    "is_causal": dict(is_causal="diagonal"),
    "window": dict(window=(1, 2, 3)),
    "softcap": dict(softcap=-1.0),
    "dropout": dict(dropout_p=0.1),
    "precision": dict(precision="low"),
    "alignment": dict(alignment="middle"),
    "key_lengths": dict(key_lengths=[1.5]),
    "gqa": dict(enable_gqa="yes"),
    "layout": dict(layout="lbhd"),
    "mask_dtype": dict(attn_mask=torch.ones(4, 4, dtype=torch.int32)),
}


@pytest.mark.parametrize("bad", list(BAD))
def test_errors_are_the_same_with_and_without_a_gradient(bad):
    """The gradient path (the operator's kernel) raises what the inference path
    (unchanged) raises, message included."""
    errors = []
    for grad in (False, True):
        q = randn(1, 2, 4, 8, grad=grad)
        with pytest.raises((TypeError, ValueError)) as e:
            at.scaled_dot_product_attention(q, q, q, **BAD[bad])
        errors.append((type(e.value), str(e.value)))
    assert errors[0] == errors[1]


def test_out_and_lse_are_saved_once():
    packed = []

    def pack(t):
        packed.append(t)
        return t
    q, k, v = randn(1, 2, 6, 8), randn(1, 2, 6, 8), randn(1, 2, 6, 8)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = at.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert len(packed) == 5                       # q, k, v, out, lse
    assert sum(t is out for t in packed) == 1     # the output returned, not a copy
    assert [tuple(t.shape) for t in packed[3:]] == [(1, 2, 6, 8), (1, 2, 6)]


# ---------------------------------------------------------------------- review's regressions

def test_flex_block_mask_changed_in_place_is_evaluated_again():
    """The mask kept on a FlexAttention BlockMask is that of what it holds now:
    a new mask_mod, or its tensors changed in place (decoding loops do), give
    the new mask's result, not the kept one's."""
    L = 32
    bm = flex.create_block_mask(lambda b, h, q, k: k <= q, None, None, L, L, device="cpu",
                                BLOCK_SIZE=16)
    q = randn(1, 2, L, 8, grad=False)
    with torch.no_grad():
        causal = at.scaled_dot_product_attention(q, q, q, attn_mask=bm)
        bm.mask_mod = lambda b, h, q, k: (k <= q) & (q - k < 4)          # a window now
        window = at.scaled_dot_product_attention(q, q, q, attn_mask=bm)
        # (in its partial blocks: the full ones stay full, as in flex_attention)
        torch.testing.assert_close(window, at.scaled_dot_product_attention(
            q, q, q, attn_mask=ops.flex_dense(bm)), rtol=0, atol=0)
        assert not torch.equal(window, causal)
        bm.kv_num_blocks.zero_()                 # in place: no block listed, every key out
        bm.full_kv_num_blocks.zero_() if bm.full_kv_num_blocks is not None else None
        empty = at.scaled_dot_product_attention(q, q, q, attn_mask=bm)
        assert not torch.equal(empty, window)


def test_export_under_no_grad_can_be_trained():
    """A program exported without a gradient keeps the lse its backward needs."""
    m = _Block()
    x = randn(2, 10, 16, grad=False)
    with torch.no_grad():
        ep = torch.export.export(m, (x,))
    y = ep.module()(x)
    y.sum().backward()
    assert any(p.grad is not None for p in ep.module().parameters())


class _BuildsMask(torch.nn.Module):
    def forward(self, x):
        bm = attnx.BlockMask.prefix_lm(x.shape[2], 4)       # NumPy, built while exporting
        return at.scaled_dot_product_attention(x, x, x, attn_mask=torch.from_numpy(bm.mask))


def test_block_mask_built_while_exporting():
    x = randn(1, 2, 16, 8, grad=False)
    ep = torch.export.export(_BuildsMask(), (x,))
    torch.testing.assert_close(ep.module()(x), _BuildsMask()(x), rtol=0, atol=0)
