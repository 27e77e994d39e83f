"""``attnx.integrations.transformers.AttnxCache``: a transformers Cache whose
layers keep keys and values in attnx KVCaches (int8, bfloat16, float16,
float32), read in place by attn_implementation="attnx".

Random-weight models built from configs (nothing downloaded): with a float32
AttnxCache, generate()'s greedy tokens and the logits equal those of the
model's default cache (Llama GQA, Gemma 2 with softcap and sliding window,
gpt-oss with sinks, a batch with and without padding, beam search,
output_attentions);
with int8, bfloat16 and float16 caches almost every token is the default's
(the rate is asserted); the cache grows, crops and resets; its placeholders
are refused under another attention implementation.
"""

import copy
import sys
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import attnx.integrations.transformers as hf  # noqa: E402
import test_transformers  # noqa: E402  (its test models; it registers attnx too)

hf.register()


def configs():
    """test_transformers.py's causal decoders: Llama (GQA), Gemma 2 (softcap and a
    sliding window), gpt-oss (sinks): (model class, config) by name."""
    return {name: spec[:2] for name, spec in test_transformers.configs().items()
            if name in ("llama_gqa", "gemma2_softcap_window", "gpt_oss_sinks")}


def build(name, impl="attnx", seed=0):
    cls, config = configs()[name]
    torch.manual_seed(seed)
    model = cls(copy.deepcopy(config)).eval()
    model.set_attn_implementation(impl)
    return model


def generate(model, ids, cache=None, **kw):
    with warnings.catch_warnings():          # past_key_values= is "cache=" from transformers 5.24
        warnings.simplefilter("ignore", FutureWarning)
        with torch.inference_mode():
            return model.generate(ids, do_sample=False, past_key_values=cache,
                                  pad_token_id=0, **kw)


def prompt(batch=1, n=12, seed=1):
    return torch.randint(1, 100, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(configs()))
def test_float32_cache_gives_the_default_caches_tokens(name):
    model = build(name)
    ids = prompt()
    want = generate(model, ids, max_new_tokens=20)
    got = generate(model, ids, hf.AttnxCache(model.config, dtype="float32"), max_new_tokens=20)
    assert got.tolist() == want.tolist()


def test_float32_cache_logits_and_attention_weights():
    model = build("llama_gqa")
    ids = prompt(n=9)
    with torch.inference_mode():
        a = model(ids, output_attentions=True)
        cache = hf.AttnxCache(model.config, dtype="float32")
        b = model(ids, past_key_values=cache, output_attentions=True)
        torch.testing.assert_close(b.logits, a.logits, atol=1e-5, rtol=1e-5)
        for wa, wb in zip(a.attentions, b.attentions):
            torch.testing.assert_close(wb, wa, atol=1e-6, rtol=1e-5)
        nxt = a.logits[:, -1:].argmax(-1)
        c = model(nxt, past_key_values=cache)
        full = model(torch.cat([ids, nxt], 1))
        torch.testing.assert_close(c.logits[:, -1], full.logits[:, -1], atol=1e-5, rtol=1e-5)
    assert cache.get_seq_length() == 10


def test_batch_without_padding_and_beam_search():
    model = build("llama_gqa")
    ids = prompt(batch=3)
    want = generate(model, ids, max_new_tokens=10)
    got = generate(model, ids, hf.AttnxCache(model.config, dtype="float32"), max_new_tokens=10)
    assert got.tolist() == want.tolist()
    want = generate(model, ids[:1], max_new_tokens=8, num_beams=3)
    got = generate(model, ids[:1], hf.AttnxCache(model.config, dtype="float32"),
                   max_new_tokens=8, num_beams=3)
    assert got.tolist() == want.tolist()


@pytest.mark.parametrize("dtype,at_least", [("int8", 0.9), ("bfloat16", 0.9), ("float16", 0.97)])
def test_low_precision_caches_almost_always_give_the_same_tokens(dtype, at_least):
    """Over 8 random models and prompts, 24 new tokens each: the share of tokens
    equal to the default cache's (until the first difference, greedy decoding
    goes its own way: the share counted is of tokens before it)."""
    same = total = 0
    for seed in range(8):
        model = build("llama_gqa", seed=seed)
        ids = prompt(seed=seed)
        want = generate(model, ids, max_new_tokens=24)[0, 12:]
        got = generate(model, ids, hf.AttnxCache(model.config, dtype=dtype),
                       max_new_tokens=24)[0, 12:]
        differ = (got != want).nonzero()
        same += int(differ[0, 0]) if len(differ) else len(want)
        total += len(want)
    assert same / total >= at_least, f"{dtype}: {same}/{total} tokens before a difference"


def test_int8_layers_hold_int8_and_scales():
    model = build("llama_gqa")
    cache = hf.AttnxCache(model.config, dtype="int8")
    generate(model, prompt(), cache, max_new_tokens=5)
    kv = cache.layers[0].cache
    assert kv.k.dtype == np.int8 and kv.k_scale.dtype == np.float32
    assert kv.lengths.tolist() == [16]       # 12 prompt tokens and 4 generated before the last


def test_int8_reorder_and_growth_keep_each_sequences_key_centre():
    """An int8 layer centres each sequence's keys on the mean of its prompt's
    (k_center, one row a sequence): beam search's reordering and the cache's
    growth move it with its sequence: attention over a reordered or grown
    cache, output and lse, is that of the rows it came from (the centre's
    shift cancels in the output and shows in the lse)."""
    model = build("llama_gqa")
    cache = hf.AttnxCache(model.config, dtype="int8")
    generate(model, prompt(batch=3), cache, max_new_tokens=3)
    layer = cache.layers[0]
    kv = layer.cache
    assert len(set(kv.k_center[:, 0, 0, 0].tolist())) == 3
    q = np.random.default_rng(0).standard_normal((3, 2 * kv.heads, 1, kv.head_dim), np.float32)
    want = kv.attend(q, return_lse=True)
    order = [2, 0, 1]
    cache.reorder_cache(torch.tensor(order))
    for got, w in zip(layer.cache.attend(q[order], return_lse=True), want):
        np.testing.assert_array_equal(got, w[order])
    layer._grow(layer.cache.max_len + 1)
    assert layer.cache is not kv and layer.cache.k_center is not None
    for got, w in zip(layer.cache.attend(q[order], return_lse=True), want):
        np.testing.assert_array_equal(got, w[order])


def test_int8_softcap_models_keep_keys_uncentred():
    """Gemma 2 softcaps its scores, under which the centre's shift would not
    cancel: its int8 layers store keys uncentred, and generate() runs."""
    model = build("gemma2_softcap_window")
    cache = hf.AttnxCache(model.config, dtype="int8")
    generate(model, prompt(), cache, max_new_tokens=4)
    assert all(layer.cache.k_center is None for layer in cache.layers)


def test_cache_grows_crops_and_resets():
    model = build("llama_gqa")
    cache = hf.AttnxCache(model.config, dtype="float32")
    ids = prompt(n=300)
    generate(model, ids, cache, max_new_tokens=3)
    layer = cache.layers[0]
    assert layer.cache.max_len >= 302 and cache.get_seq_length() == 302
    cache.crop(-2)
    assert cache.get_seq_length() == 300
    cache.reset()
    assert cache.get_seq_length() == 0
    fixed = hf.AttnxCache(model.config, dtype="int8", max_cache_len=20)
    with pytest.raises(ValueError, match="max_cache_len=20"):
        generate(model, prompt(n=30), fixed, max_new_tokens=2)


def test_refused_under_another_attention_implementation():
    model = build("llama_gqa", impl="sdpa")
    with pytest.raises(ValueError, match="'attnx' attention implementation only"):
        generate(model, prompt(), hf.AttnxCache(model.config), max_new_tokens=2)


@pytest.mark.parametrize("name", ["llama_gqa", "gemma2_softcap_window"])
def test_left_padded_batch(name):
    """Prompts of different lengths, left-padded: the model's padding mask reaches
    the cache's attention; the tokens equal the default cache's (float32), and
    those of each prompt generated alone; an int8 cache generates too."""
    model = build(name)
    ids = prompt(batch=3)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, :7] = 0
    ids = ids * mask                                 # pad_token_id=0 where masked
    want = generate(model, ids, attention_mask=mask, max_new_tokens=10)
    got = generate(model, ids, hf.AttnxCache(model.config, dtype="float32"),
                   attention_mask=mask, max_new_tokens=10)
    assert got.tolist() == want.tolist()
    for b, pad in enumerate((0, 4, 7)):
        alone = generate(model, ids[b:b + 1, pad:], hf.AttnxCache(model.config, dtype="float32"),
                         max_new_tokens=10)
        n = alone.shape[1]                  # shorter where it ends at eos, padded in the batch
        assert alone[0].tolist() == got[b, pad:pad + n].tolist()
    got8 = generate(model, ids, hf.AttnxCache(model.config, dtype="int8"),
                    attention_mask=mask, max_new_tokens=10)
    assert got8.shape == got.shape


def test_bad_arguments():
    model = build("llama_gqa")
    with pytest.raises(ValueError, match="dtype must be one of"):
        hf.AttnxCache(model.config, dtype="int4")
    with pytest.raises(ValueError, match="num_hidden_layers"):
        hf.AttnxCache(object())


def test_placeholders_never_read_twice_unnoticed():
    """update returns placeholders only attnx's attention reads; a second update of
    a layer whose placeholders nobody read (another attention, a copy of the keys)
    raises instead of letting zeros through."""
    model = build("llama_gqa")
    cache = hf.AttnxCache(model.config, dtype="float32")
    k = torch.randn(1, 2, 3, 16)
    keys, values = cache.update(k, k, 0)
    assert keys.shape == (1, 2, 3, 16) and not keys.any()
    assert cache.layers[0].pending
    with pytest.raises(ValueError, match="not read by attnx's attention"):
        cache.update(k, k, 0)
    q = torch.randn(1, 4, 3, 16)
    with pytest.raises(ValueError, match="no position_bias"):
        hf.attention_forward(model.model.layers[0].self_attn, q, keys, values, None,
                             position_bias=torch.zeros(1, 4, 3, 3))
    out, _ = hf.attention_forward(model.model.layers[0].self_attn, q, keys, values, None)
    assert out.shape == (1, 3, 4, 16) and not cache.layers[0].pending


def test_threads_generating_with_their_own_padding():
    """Issue 42: the padding mask checked once a step belongs to the cache, not
    to the module. Threads generating at once with caches of their own and
    batches padded differently (same shapes and other shapes) each get the
    tokens they get alone (the old module-global memo let a thread apply
    another's mask, or raise on its shape)."""
    import threading
    model = build("llama_gqa")
    batches = []
    for t, (batch, pads) in enumerate([(3, (0, 4, 7)), (3, (5, 0, 2)), (2, (0, 6)),
                                       (3, (1, 1, 0))]):
        ids = prompt(batch=batch, seed=10 + t)
        mask = torch.ones_like(ids)
        for b, pad in enumerate(pads):
            mask[b, :pad] = 0
        batches.append((ids * mask, mask))
    want = [generate(model, ids, hf.AttnxCache(model.config, dtype="float32"),
                     attention_mask=mask, max_new_tokens=8).tolist() for ids, mask in batches]
    rounds, got, errors = 3, [[None] * len(batches) for _ in range(3)], []
    start = threading.Barrier(len(batches))

    def run(i):
        ids, mask = batches[i]
        try:
            start.wait()
            for r in range(rounds):
                got[r][i] = generate(model, ids, hf.AttnxCache(model.config, dtype="float32"),
                                     attention_mask=mask, max_new_tokens=8).tolist()
        except Exception as e:               # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(batches))]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)          # threads switch often: a shared memo is caught
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors
    for r in range(rounds):
        assert got[r] == want


def module_state(exclude=("NAMES", "_PLACEHOLDERS")):
    """Every mutable module-level container of attnx's transformers integration,
    copied (``NAMES`` changes in register() only; ``_PLACEHOLDERS`` maps each live
    layer's own placeholder address to it: no call reads another's entry)."""
    import attnx.integrations as pkg
    import importlib
    import pkgutil
    out = {}
    for info in pkgutil.iter_modules(pkg.__path__):
        mod = importlib.import_module(f"{pkg.__name__}.{info.name}")
        for name, value in vars(mod).items():
            if name not in exclude and isinstance(value, (list, dict, set)):
                out[f"{info.name}.{name}"] = copy.copy(value)
    return out


def test_no_module_global_state_on_the_attention_path():
    """Issue 42: generating (a left-padded batch, then another) leaves every
    module-level container of the integration as it was: what a step caches
    belongs to the cache."""
    model = build("llama_gqa")
    before = module_state()
    for pads in ((0, 3), (2, 0)):
        ids = prompt(batch=2)
        mask = torch.ones_like(ids)
        for b, pad in enumerate(pads):
            mask[b, :pad] = 0
        generate(model, ids * mask, hf.AttnxCache(model.config, dtype="float32"),
                 attention_mask=mask, max_new_tokens=3)
    after = module_state()
    assert after.keys() == before.keys()
    for name in before:
        assert after[name] == before[name] if not isinstance(before[name], list) else \
            all(a is b for a, b in zip(after[name], before[name])), name
