"""bfloat16 models with attn_implementation="attnx" (the dtype transformers loads
most checkpoints in): the tiny models of test_transformers.py converted to
bfloat16 run, generate and train through attnx.torch, and their logits are at
least as close to the float32 model's as those of the model's own attention in
bfloat16; gradients flow in bfloat16. attnx.torch itself: bfloat16 tensors in,
bfloat16 out, gradients against float64 torch autograd on the same values."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import attnx.torch as at  # noqa: E402
from test_transformers import build, configs, inputs, result  # noqa: E402

@pytest.mark.parametrize("name", list(configs()))
def test_bfloat16_model_is_as_close_to_float32_as_its_own_attention(name):
    ids, mask = inputs()
    reference = build(name, configs()[name][2])                  # float32, the model's own
    ours, theirs = build(name, "attnx").to(torch.bfloat16), build(name, configs()[name][2]).to(torch.bfloat16)
    with torch.no_grad():
        want = result(reference(input_ids=ids, attention_mask=mask))
        a = result(ours(input_ids=ids, attention_mask=mask))
        b = result(theirs(input_ids=ids, attention_mask=mask))
    assert a.dtype == torch.bfloat16
    real = mask.bool()

    def rms(x):
        return float(((x.float() - want)[real] ** 2).mean().sqrt())
    # the bfloat16 rounding of the rest of the model dominates both (attnx computes in
    # float32); measured: attnx closer for four models, 0.5% further for gpt_oss_sinks
    assert rms(a) <= 1.05 * rms(b), (rms(a), rms(b))


@pytest.mark.parametrize("name", ["llama_gqa", "gemma2_softcap_window"])
def test_bfloat16_model_generates_and_trains(name):
    ids, mask = inputs()
    model = build(name, "attnx").to(torch.bfloat16)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert out.shape == (2, 22)
    model.train()
    for p in model.parameters():
        p.requires_grad_(True)
    loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    q_proj = model.model.layers[0].self_attn.q_proj.weight
    assert q_proj.grad is not None and q_proj.grad.dtype == torch.bfloat16
    assert torch.isfinite(q_proj.grad.float()).all() and q_proj.grad.abs().sum() > 0


@pytest.mark.parametrize("causal", [False, "lower_right"])
def test_attnx_torch_bfloat16(causal):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 9, 16, generator=g).bfloat16().requires_grad_()
    k = torch.randn(2, 2, 12, 16, generator=g).bfloat16().requires_grad_()
    v = torch.randn(2, 2, 12, 16, generator=g).bfloat16().requires_grad_()
    out = at.scaled_dot_product_attention(q, k, v, enable_gqa=True, is_causal=causal)
    assert out.dtype == torch.bfloat16
    dout = torch.randn(out.shape, generator=g).bfloat16()
    out.backward(dout)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    mask = torch.ones(9, 12, dtype=torch.bool).tril(3) if causal else None
    ref = torch.nn.functional.scaled_dot_product_attention(
        q64, k64.repeat_interleave(2, 1), v64.repeat_interleave(2, 1), attn_mask=mask)
    ref.backward(dout.double())
    # the float32 result on the bfloat16 values, rounded once to bfloat16 (2^-8 relative)
    torch.testing.assert_close(out.double(), ref, atol=1e-2, rtol=8e-3)
    for got, want in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), want, atol=1e-2, rtol=8e-3)
