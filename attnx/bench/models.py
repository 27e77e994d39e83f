"""Whole workloads: a Llama-style decoder through Hugging Face transformers
(attn_implementation "attnx", "sdpa" and "eager") and attnx.dask on a
2-process cluster. Each needs its extra; without it the measurement gives no
rows."""

from __future__ import annotations

from typing import Any, Callable, Dict, List

from .context import Context
from .rows import Row


def decode_step(torch: Any, model: Any, ids: Any) -> Callable[[], object]:
    """One greedy decoding step of ``model`` after the prompt ``ids`` (1, L): the
    prompt's cache is built once; each call feeds the next token with that
    cache, then crops the cache back to L tokens, so that every call decodes at
    the same context length. (Timing generate() of n tokens minus generate() of
    one instead leaves the prefill's run-to-run noise in the difference, which
    swamps the decoding at a few thousand tokens.)"""
    import inspect
    with torch.no_grad():
        first = model(input_ids=ids, use_cache=True)
    # transformers >= 5.24 names the cache "cache" (and warns at "past_key_values")
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache, token = first[name], first.logits[:, -1:].argmax(-1)

    def step() -> object:
        with torch.no_grad():
            out = model(input_ids=token, use_cache=True, **{name: cache})
        cache.crop(-1)
        return out
    return step


def transformers_decoder(ctx: Context, L: int, dtype: str = "float32",
                         small: bool = True) -> List[Row]:
    """A Llama-style decoder with random weights, in ``dtype``, with
    attn_implementation "attnx", "sdpa" and "eager": the prefill of L
    tokens, and one decoding step at a context of L tokens
    (:func:`decode_step`). ``small``: 4 layers, d_model 512, 8 query and 2
    key/value heads; else SmolLM-135M's shape (30 layers, hidden 576, 9
    query and 3 key/value heads of 64, vocabulary 49152)."""
    torch = ctx.torch
    try:
        import transformers
    except ImportError:
        return []
    from ..integrations import transformers as hf
    hf.register()
    torch.set_num_threads(ctx.threads)
    ctx.attnx.set_num_threads(ctx.threads)
    shape: Dict[str, Any] = (
        dict(vocab_size=1000, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=2) if small else
        dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
             num_attention_heads=9, num_key_value_heads=3, head_dim=64,
             tie_word_embeddings=True))
    config = transformers.LlamaConfig(max_position_embeddings=8192, **shape)
    models = {}
    for impl in ("attnx", "sdpa", "eager"):
        torch.manual_seed(0)
        m: Any = transformers.LlamaForCausalLM(config.__class__(**config.to_dict()))
        m.eval()
        m.set_attn_implementation(impl)
        models[impl] = m.to(getattr(torch, dtype))
    ids = torch.randint(0, shape["vocab_size"], (1, L),
                        generator=torch.Generator().manual_seed(0))

    def prefill(m: Any) -> Callable[[], object]:
        def run() -> object:
            with torch.no_grad():
                return m(input_ids=ids)
        return run

    names = list(models)
    t_pre = dict(zip(names, ctx.time([prefill(models[n]) for n in names])))
    steps = [decode_step(torch, models[n], ids) for n in names]
    per_token = dict(zip(names, ctx.time(steps)))
    rows: List[Row] = []
    for what, times in (("prefill", t_pre), ("decode, per token", per_token)):
        kind = "Llama-style decoder" if small else "SmolLM-135M-shaped decoder"
        row: Row = {"case": f"{kind} {dtype} {what}, L={L}", "threads": ctx.threads,
                    "attnx_s": times["attnx"], "sdpa_s": times["sdpa"],
                    "eager_s": times["eager"], "vs_torch": times["sdpa"] / times["attnx"],
                    "note": f"attnx {1e3 * times['attnx']:.1f} ms, sdpa "
                            f"{1e3 * times['sdpa']:.1f} ms, eager {1e3 * times['eager']:.1f} ms"}
        rows.append(row)
    ctx.attnx.set_num_threads(0)
    return rows


def dask_cluster(ctx: Context, L: int, H: int, D: int, chunk: int) -> List[Row]:
    """Causal attention over (1, H, L, D) on a 2-process dask LocalCluster
    (attnx.dask, chunks of ``chunk`` queries and keys) against one process."""
    try:
        from .. import dask as adask
    except ImportError:
        return []
    r = adask.bench(L, H, D, chunk, n_workers=2, repeats=min(ctx.repeats, 3))
    dask_s, numpy_s = float(r["dask_s"]), float(r["numpy_s"])
    flops = 4.0 * H * L * L * D / 2          # causal: half the scores
    row: Row = {"case": f"dask 2 workers, causal L={L} H={H} D={D}", "threads": ctx.threads,
                "attnx_s": dask_s, "attnx_gflops": flops / dask_s / 1e9,
                "one_process_s": numpy_s, "one_process_gflops": flops / numpy_s / 1e9,
                "note": f"{dask_s:.2f} s vs one process {numpy_s:.2f} s "
                        f"({dask_s / numpy_s:.2f}x the time); {r['case']}"}
    ctx.attnx.set_num_threads(0)
    return [row]
