"""attn_implementation="attnx" in Hugging Face transformers models built from
small configs with random weights (nothing is downloaded): the same hidden
states as the models' own "sdpa" (or "eager", where sdpa cannot express the
model: softcap, sinks), the same greedy generate() tokens, the same gradients;
a user's own 4-D additive float attention_mask (with -inf and -1e9 entries) in
BERT and Llama: the same hidden states as "sdpa" and the same gradients,
the mask's included."""

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import attnx.integrations.transformers as hf  # noqa: E402

hf.register()


def configs():
    T = transformers
    return {
        "bert": (T.BertModel, T.BertConfig(
            vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=96, attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0), "sdpa"),
        "llama_gqa": (T.LlamaForCausalLM, T.LlamaConfig(
            vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=96), "sdpa"),
        "qwen2_gqa": (T.Qwen2ForCausalLM, T.Qwen2Config(
            vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=1, intermediate_size=96), "sdpa"),
        "gemma2_softcap_window": (T.Gemma2ForCausalLM, T.Gemma2Config(
            vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, intermediate_size=96, sliding_window=6,
            attn_logit_softcapping=2.0, final_logit_softcapping=None, initializer_range=0.5), "eager"),
        "gpt_oss_sinks": (T.GptOssForCausalLM, T.GptOssConfig(
            vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, intermediate_size=64, num_local_experts=4,
            num_experts_per_tok=2, sliding_window=6, experts_implementation="eager"), "eager"),
    }


def build(name, impl):
    cls, config, _ = configs()[name]
    torch.manual_seed(0)
    model = cls(copy.deepcopy(config))     # each model its own config: the implementation is set there
    model.eval()
    model.set_attn_implementation(impl)
    assert model.config._attn_implementation == impl
    return model


def inputs(padding="left"):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 100, (2, 17), generator=g)
    mask = torch.ones(2, 17, dtype=torch.long)
    if padding == "left":                   # as generate() batches are padded
        mask[1, :5] = 0
    else:                                   # no query row without a key: no NaN in float64 eager
        mask[1, -5:] = 0
    return ids, mask


def result(out):
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out.logits


def assert_grads_close(ours, theirs, exact):
    """Each gradient of ours (attnx) against the float64 one (exact): within torch.testing's
    float32 tolerance, or no further off than twice the model's own attention (theirs) is."""
    for n, g in exact.items():
        err, ref_err = (ours[n] - g).abs(), (theirs[n] - g).abs()
        tol = 1e-5 + 1.3e-6 * g.abs()                 # torch.testing's float32 defaults
        ok = (err <= tol) | (err <= 2 * ref_err.max() + tol)
        assert bool(ok.all()), (f"{n}: attnx off by {float(err.max()):.2e}, the model's own "
                                f"attention by {float(ref_err.max()):.2e}")


@pytest.mark.parametrize("name", list(configs()))
def test_forward_matches_the_models_own_attention(name):
    ids, mask = inputs()
    ours, theirs = build(name, "attnx"), build(name, configs()[name][2])
    calls = []
    original = hf.attention_forward

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)
    transformers.AttentionInterface.register("attnx", counting)
    try:
        with torch.no_grad():
            a, b = result(ours(input_ids=ids, attention_mask=mask)), result(theirs(input_ids=ids, attention_mask=mask))
    finally:
        hf.register()
    assert calls, "attnx's attention function was not called"
    real = mask.bool()
    err = (a - b)[real].abs().max() / b[real].abs().max()
    assert err < 1e-5, f"{name}: relative difference {float(err):.2e}"


@pytest.mark.parametrize("name", [n for n in configs() if n != "bert"])
def test_greedy_generate_gives_the_same_tokens(name):
    ids, mask = inputs()
    ours, theirs = build(name, "attnx"), build(name, configs()[name][2])
    a = ours.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    b = theirs.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    assert torch.equal(a, b)


@pytest.mark.parametrize("name", list(configs()))
def test_output_attentions_gives_the_weights_of_eager(name):
    """output_attentions=True: attnx computes the weights (need_weights), the same as
    the model's "eager" attention (rows of padded queries aside), sinks and sliding
    windows included; the hidden states stay those of the call without weights (to
    float32's rounding: the weights' pass normalises each probability before the sum)."""
    ids, mask = inputs()
    ours, eager = build(name, "attnx"), build(name, "eager")
    with torch.no_grad():
        a = ours(input_ids=ids, attention_mask=mask, output_attentions=True)
        b = eager(input_ids=ids, attention_mask=mask, output_attentions=True)
        plain = result(ours(input_ids=ids, attention_mask=mask))
    assert len(a.attentions) == len(b.attentions) == 2
    real = mask.bool()[:, None, :, None]               # (B, 1, Lq, 1): queries that are tokens
    for wa, wb in zip(a.attentions, b.attentions):
        assert wa.shape == wb.shape
        assert float(((wa - wb).abs() * real).max()) < 1e-5
    err = (result(a) - plain).abs().max() / plain.abs().max()
    assert err < 1e-5, f"{name}: relative difference {float(err):.2e}"


def test_sliding_window_reaches_the_core_as_window(monkeypatch):
    """A sliding-window layer's prompt (no past) passes window=(sliding_window - 1, 0),
    so that the core skips the key tiles outside the band; decoding with a cache
    does not (the mask says where the cached keys lie). The tokens stay "eager"'s."""
    import attnx.torch
    from attnx.integrations import _implementation
    seen = []
    original = attnx.torch.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((args[0].shape[2], args[1].shape[2], kwargs.get("window")))
        return original(*args, **kwargs)
    monkeypatch.setattr(_implementation, "_attention", spy)
    ids, mask = inputs()
    ours, eager = build("gemma2_softcap_window", "attnx"), build("gemma2_softcap_window", "eager")
    a = ours.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    b = eager.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert torch.equal(a, b)
    windows = {w for lq, lk, w in seen if lq == lk}
    assert (5, 0) in windows                       # sliding_window=6: the local layer
    assert all(w is None for lq, lk, w in seen if lq != lk)


def parameter_grads(name, impl, dtype=torch.float32):
    ids, mask = inputs("right")
    model = build(name, impl).to(dtype)
    out = result(model(input_ids=ids, attention_mask=mask))
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    loss = (out * w.to(dtype) * mask[..., None]).sum()        # a random upstream gradient
    loss.backward()
    return {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", list(configs()))
def test_gradients_match(name):
    """Every parameter's gradient, attnx against the model's own float32 attention,
    both measured against the same model run in float64 ("eager"): attnx's error
    is within PyTorch's float32 tolerance of the exact gradient, or no larger
    than that of the model's own attention (two layers of float32 arithmetic
    around the attention add their own rounding)."""
    ours, theirs = parameter_grads(name, "attnx"), parameter_grads(name, configs()[name][2])
    exact = parameter_grads(name, "eager", torch.float64)
    assert ours.keys() == theirs.keys() == exact.keys() and ours
    if name == "gpt_oss_sinks":
        assert any("sinks" in n and ours[n].abs().max() > 0 for n in ours), "the sinks got no gradient"
    assert_grads_close(ours, theirs, exact)


def test_training_with_attention_dropout_is_refused():
    cls, config, _ = configs()["llama_gqa"]
    config = copy.deepcopy(config)
    config.attention_dropout = 0.1
    model = cls(config)
    model.set_attn_implementation("attnx")
    model.train()
    ids, mask = inputs()
    with pytest.raises(ValueError, match="dropout"):
        model(input_ids=ids, attention_mask=mask)
    model.eval()                              # no dropout at inference: fine
    model(input_ids=ids, attention_mask=mask)


@pytest.mark.parametrize("name, exc", [(123, TypeError), (None, TypeError), (b"attnx", TypeError),
                                       (("attnx",), TypeError), ("", ValueError)])
def test_register_refuses_a_name_that_is_not_a_non_empty_str(name, exc):
    """Issue 56, 5: register(name=123) was accepted (transformers' interfaces
    took 123 as a key no model can name). The name is a non-empty str:
    TypeError for another type, ValueError for "", each naming the argument and
    the value, and nothing registered."""
    before = set(transformers.AttentionInterface._global_mapping)
    with pytest.raises(exc, match="name must be a (non-empty )?str") as info:
        hf.register(name)
    assert str(info.value).endswith(repr(name))
    assert set(transformers.AttentionInterface._global_mapping) == before
    assert hf.register(name="attnx") == "attnx"


def user_float_mask(name, dtype=torch.float32):
    """An additive float mask the user builds and passes as ``attention_mask``,
    4-D (B, 1, Lq, Lk) (transformers hands a 4-D mask to the attention as it is,
    with no causal flag): a soft bias on every score (additive, not a boolean in
    disguise), -inf on two keys of the first sequence, -1e9 on the padded keys of
    the second (as masks built by hand from ``(1 - mask) * -1e9`` are) and, for
    the decoders, -inf above the diagonal. No query row is left without a key.
    Returns the mask and the (B, L) real positions."""
    g = torch.Generator().manual_seed(3)
    m = -torch.rand(2, 1, 17, 17, generator=g, dtype=torch.float64)
    m[0, :, :, [3, 10]] = float("-inf")
    real = torch.ones(2, 17, dtype=torch.bool)
    if name == "bert":
        m[1, :, :, -5:] = -1e9
        real[1, -5:] = False
    else:
        m = m.masked_fill(torch.ones(17, 17, dtype=torch.bool).triu(1), float("-inf"))
        m[1, :, :, :5] = -1e9
        real[1, :5] = False
    return m.to(dtype), real


@pytest.mark.parametrize("name", ["bert", "llama_gqa"])
def test_user_float_4d_mask_matches_the_models_own_attention(name):
    """A user's own 4-D additive float mask (BERT-style encoder; a GQA decoder
    whose mask holds the causal part too): the same hidden states as "sdpa" and
    the mask's and every parameter's gradient (the mask requires grad), each
    measured against the model in float64 "eager" as in test_gradients_match."""
    ids, _ = inputs()
    runs = {}
    for impl, dtype in (("attnx", torch.float32), ("sdpa", torch.float32), ("eager", torch.float64)):
        model = build(name, impl).to(dtype)
        mask, real = user_float_mask(name, dtype)
        mask.requires_grad_(True)
        out = result(model(input_ids=ids, attention_mask=mask))
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        (out * w.to(dtype) * real[..., None]).sum().backward()     # a random upstream gradient
        grads = {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}
        grads["attention_mask"] = mask.grad.double()
        runs[impl] = out.detach().double(), grads
    (a, ours), (b, theirs), (_, exact) = runs["attnx"], runs["sdpa"], runs["eager"]
    err = (a - b)[real].abs().max() / b[real].abs().max()
    assert err < 1e-5, f"{name}: relative difference {float(err):.2e}"
    assert ours.keys() == theirs.keys() == exact.keys() and len(ours) > 1
    assert ours["attention_mask"][:, :, :, [3, 10]][0].abs().max() == 0     # -inf keys: no gradient
    assert ours["attention_mask"].abs().max() > 0
    assert_grads_close(ours, theirs, exact)
