"""transformers' continuous batching (``model.generate_batch``) with attn_implementation="attnx".

A tiny random Llama (GQA, 4 query heads on 2 key/value heads), built from a
config: its greedy tokens under attnx equal those of transformers' own
continuous batching with "sdpa", in float32 (and in bfloat16 almost always),
with pages of 4, 16 and 256 rows and chunked prefills (a small
``max_batch_tokens``). The cache is read in place: the attention gets the
cache's own memory and a block table, and transformers' gathering update is
not called for attnx's full-attention layers.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.generation.continuous_batching")

from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402
from transformers.generation.continuous_batching.cache import PagedAttentionCache  # noqa: E402

import attnx.integrations.transformers as tr  # noqa: E402
from attnx.integrations import _continuous_batching as cb  # noqa: E402

PROMPTS = [[1, 5, 9, 17, 33], [2, 4, 6], [7, 8, 9, 10, 11, 12, 13], list(range(3, 40)),
           list(range(5, 120)), [9]]


def _model(dtype):
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                      max_position_embeddings=512)
    return LlamaForCausalLM(cfg).eval().to(dtype)


def _generate(model, impl, page, max_batch_tokens, new=10):
    model.set_attn_implementation(impl)
    gc = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cbc = ContinuousBatchingConfig(page_size=page, num_blocks=64, max_batch_tokens=max_batch_tokens)
    out = model.generate_batch(inputs=PROMPTS, generation_config=gc,
                               continuous_batching_config=cbc, progress_bar=False)
    return [out[f"req_{i}"].generated_tokens for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def registered():
    return tr.register()


@pytest.mark.parametrize("page, max_batch_tokens", [(16, 24), (256, 64), (4, 500)])
def test_greedy_tokens_equal_sdpa_in_float32(registered, page, max_batch_tokens):
    model = _model(torch.float32)
    want = _generate(model, "sdpa", page, max_batch_tokens)
    got = _generate(model, registered, page, max_batch_tokens)
    assert got == want
    assert all(len(t) == 10 for t in got)


def test_greedy_tokens_in_bfloat16_under_inference_mode(registered):
    """Under torch.inference_mode (inference tensors: no version counters).
    transformers runs its generation loop in the caller's inference mode from
    5.24 on; in 5.23 the loop cannot start under it (for "sdpa" too: an
    in-place update of an inference tensor), so there no_grad stands in."""
    model = _model(torch.bfloat16)
    from attnx.integrations._continuous_batching import _release
    mode = (torch.inference_mode() if _release(transformers.__version__) >= (5, 24)
            else torch.no_grad())
    with mode:
        want = _generate(model, "sdpa", 16, 24)
        got = _generate(model, registered, 16, 24)
    same = sum(a == b for x, y in zip(want, got) for a, b in zip(x, y))
    assert same >= 0.9 * sum(len(x) for x in want), (want, got)


def test_the_cache_is_read_in_place(registered, monkeypatch):
    """Every attention call after the first prefill reads the cache's own
    memory through a block table, and transformers' update (which gathers
    every key with index_select) is not called for attnx."""
    calls, updates = [], []
    real_varlen, real_update = cb.varlen_attention, cb._original_update

    def spy_varlen(q, k, v, cq, ck, *, block_table=None, **kw):
        calls.append((block_table is not None, k, int(ck[-1]), q.shape[0]))
        return real_varlen(q, k, v, cq, ck, block_table=block_table, **kw)

    def spy_update(*args, **kwargs):
        updates.append(1)
        return real_update(*args, **kwargs)

    monkeypatch.setattr(cb, "varlen_attention", spy_varlen)
    monkeypatch.setattr(cb, "_original_update", spy_update)
    model = _model(torch.float32)
    _generate(model, registered, 16, 24)
    assert calls and not updates
    paged = [c for c in calls if c[0]]
    # every call that reads a past does so from the pages (the first prefill
    # of a batch has no past: its keys are the new ones, passed as they are)
    assert len(paged) >= len(calls) - 2 * 2, [c[0] for c in calls]
    for _, k, total_k, _ in paged:
        assert k.ndim == 4 and k.shape[1] == 16          # (pages, page_size, Hk, D)
        assert k.base is not None                        # a view, not a copy
    assert any(total_k > total_q for _, _, total_k, total_q in paged)


def test_pages_laid_out_otherwise_are_gathered(registered, monkeypatch):
    """If read_index were not whole pages in order, the keys are gathered
    (as transformers does) and the tokens stay the same."""
    monkeypatch.setattr(cb, "_block_table", lambda ri, ck, page: None)
    model = _model(torch.float32)
    assert _generate(model, registered, 16, 24) == _generate(model, "sdpa", 16, 24)


def test_block_table_of_read_index():
    page = 4
    # request 0: 6 keys in pages 7, 2; request 1: 0 keys; request 2: 4 keys in page 5
    ri = np.array([28, 29, 30, 31, 8, 9, 20, 21, 22, 23])
    ck = np.array([0, 6, 6, 10])
    t = cb._block_table(ri, ck, page)
    assert t is not None and t[0, :2].tolist() == [7, 2] and t[2, 0] == 5
    assert cb._block_table(np.array([28, 29, 30, 31, 9, 8, 20, 21, 22, 23]), ck, page) is None
    assert cb._block_table(np.array([29, 30, 31, 32, 8, 9, 20, 21, 22, 23]), ck, page) is None
    assert cb._block_table(ri[:-1], ck, page) is None


def test_sdpa_is_untouched_by_the_hooks(registered):
    """After register(), sdpa's continuous batching runs transformers' own
    update (with its gather) as before, and attnx's names are the only ones
    the hooks act for."""
    assert registered in cb.NAMES and "sdpa" not in cb.NAMES
    assert PagedAttentionCache.update is not cb._original_update
    model = _model(torch.float32)
    assert len(_generate(model, "sdpa", 16, 24, new=3)[0]) == 3


def test_register_refuses_releases_outside_the_supported_range(monkeypatch):
    """Issue 42: a release the integration was not checked on is refused by
    register() by name and range, before anything is registered (5.0-5.22
    passed cu_seq_lens_k and the cache otherwise, and every request came back
    empty)."""
    lo, hi = cb.SUPPORTED
    cb.check_version(transformers.__version__)        # the installed one is supported
    for v in ("5.22.2", "4.57.1", hi + ".0.0", "99.0.0"):
        with pytest.raises(RuntimeError, match=rf"transformers>={lo},<{hi} .*this is "
                                               rf"transformers {v}"):
            cb.check_version(v)
    for v in (lo + ".0", lo + ".1", "5.24.0", "5.30.0.dev0"):
        cb.check_version(v)
    # (the module in sys.modules: transformers' lazy module replaces itself there)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.22.0")
    with pytest.raises(RuntimeError, match="this is transformers 5.22.0"):
        tr.register("attnx_too_old")
    from transformers import AttentionInterface
    assert "attnx_too_old" not in AttentionInterface._global_mapping


def test_the_extras_admit_the_supported_range():
    """pyproject's [transformers] and [test] extras say what SUPPORTED says."""
    import pathlib
    import re
    path = pathlib.Path(__file__).parents[1] / "pyproject.toml"
    if not path.exists():
        pytest.skip("run from a copy of tests/ without the source tree (the install matrix)")
    text = path.read_text()
    lo, hi = cb.SUPPORTED
    found = re.findall(r'"transformers([<>=][^"]*)"', text)
    assert found and all(f == f">={lo},<{hi}" for f in found), found


def test_a_failing_step_is_not_silent(registered, monkeypatch):
    """transformers' loop catches an exception of the attention and hands the
    requests back without tokens: attnx warns with the error first."""
    def broken(*args, **kwargs):
        raise ValueError("broken on purpose")

    monkeypatch.setattr(cb, "varlen_attention", broken)
    model = _model(torch.float32)
    with pytest.warns(RuntimeWarning, match="continuous-batching step failed.*broken on purpose"):
        got = _generate(model, registered, 16, 24, new=2)
    assert all(len(t) == 0 for t in got)


def test_no_module_global_state(registered):
    """Issue 42: a continuous-batching run leaves the integration's module-level
    containers as they were (the step's block table is kept by the cache)."""
    from test_attnx_cache import module_state
    before = module_state()
    _generate(_model(torch.float32), registered, 16, 24, new=3)
    assert module_state() == before


def test_a_sliding_window_model_equals_sdpa(registered):
    """Mistral with a window shorter than the prompts: its sliding layers keep
    transformers' own update (a ring buffer, read before written), and the
    window applies per request."""
    from transformers import MistralConfig, MistralForCausalLM
    torch.manual_seed(0)
    cfg = MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                        max_position_embeddings=512, sliding_window=8)
    model = MistralForCausalLM(cfg).eval()
    assert _generate(model, registered, 16, 24) == _generate(model, "sdpa", 16, 24)


def test_padding_free_training_keeps_its_gradients(registered):
    """cu_seq_lens_q without a paged cache (DataCollatorWithFlattening's
    padding-free batches) is no continuous-batching step: gradients flow."""
    model = _model(torch.float32).train()
    model.set_attn_implementation(registered)
    ids = torch.tensor([[1, 5, 9, 17, 2, 4, 6]])
    cu = torch.tensor([0, 4, 7], dtype=torch.int32)
    out = model(input_ids=ids, position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2]]),
                cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=4, max_length_k=4)
    out.logits.sum().backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
