"""Decoding at long contexts with transformers: the default cache against
attnx's AttnxCache in bfloat16 and in int8.

    python tools/attnx_cache_bench.py                      # the table of docs/guide/kvcache.md
    python tools/attnx_cache_bench.py --contexts 4096 --layers 4   # quicker

A SmolLM-135M-shaped Llama (30 layers, hidden 576, 9 query heads on 3
key/value heads, head_dim 64) with random weights, built from its config
(nothing downloaded), in --dtype (bfloat16 by default), attn_implementation
"attnx". Each cache is filled with --context random keys and values in every
layer through its own ``update`` (as a prefill would leave it, without
paying for one), then the model decodes one token at a time on it; the
contestants' steps are interleaved (one step each in turn, --steps rounds),
and each step's cache is cropped back so every step sees the same context.
Reports the median step time (tokens/s), the bytes of the cache (keys,
values and the int8 cache's scales) and the ratio to the default cache.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Dict, List

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from serving_bench import _config  # noqa: E402  (the SmolLM2-135M shape)


def _fill(cache: Any, layers: int, context: int, heads: int, head_dim: int, dtype: Any) -> None:
    g = torch.Generator().manual_seed(0)
    for i in range(layers):
        k = torch.randn(1, heads, context, head_dim, generator=g).to(dtype)
        v = torch.randn(1, heads, context, head_dim, generator=g).to(dtype)
        cache.update(k, v, i)


def _cache_bytes(cache: Any) -> int:
    from attnx.integrations.transformers import AttnxCache
    if isinstance(cache, AttnxCache):
        total = 0
        for layer in cache.layers:
            c = layer.cache
            total += c.k.nbytes + c.v.nbytes
            if c.k_scale is not None:
                total += c.k_scale.nbytes + c.v_scale.nbytes
        return total
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32768])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()

    import attnx
    import attnx.integrations.transformers as tr
    from transformers import DynamicCache, LlamaForCausalLM
    torch.set_num_threads(a.threads)
    attnx.set_num_threads(a.threads)
    tr.register()
    torch.manual_seed(0)
    cfg = _config(a.layers)
    cfg.max_position_embeddings = max(a.contexts) + 64
    dtype = getattr(torch, a.dtype)
    model = LlamaForCausalLM(cfg).eval().to(dtype)
    model.set_attn_implementation("attnx")
    heads, head_dim = cfg.num_key_value_heads, cfg.head_dim
    rows: List[Dict[str, Any]] = []
    for context in a.contexts:
        caches = {"default (DynamicCache)": DynamicCache(config=cfg),
                  "AttnxCache bfloat16": tr.AttnxCache(cfg, dtype="bfloat16",
                                                       max_cache_len=context + 1),
                  "AttnxCache int8": tr.AttnxCache(cfg, dtype="int8", max_cache_len=context + 1)}
        for c in caches.values():
            _fill(c, a.layers, context, heads, head_dim, dtype)
        times: Dict[str, List[float]] = {n: [] for n in caches}
        token = torch.tensor([[1]])
        pos = torch.tensor([[context]])
        with torch.inference_mode():
            for step in range(a.steps + 1):
                for name, c in caches.items():
                    time.sleep(0.3)          # OpenBLAS/OpenMP spinning after the last one
                    t = time.perf_counter()
                    model(token, past_key_values=c, position_ids=pos,
                          cache_position=pos[0])
                    dt = time.perf_counter() - t
                    c.crop(-1)
                    if step:                 # the first round warms up
                        times[name].append(dt)
        base = statistics.median(times["default (DynamicCache)"])
        for name, c in caches.items():
            med = statistics.median(times[name])
            rows.append({"context": context, "cache": name, "ms": med * 1e3,
                         "tokens_per_s": 1 / med, "speedup": base / med,
                         "cache_MiB": _cache_bytes(c) / 2**20})
            print(f"  {context} {name}: {med * 1e3:.1f} ms/token, "
                  f"{rows[-1]['cache_MiB']:.0f} MiB", file=sys.stderr)
        del caches
    print(f"\n{a.layers} layers, SmolLM-135M shape, {a.dtype} model, attn_implementation="
          f"\"attnx\", {a.threads} threads, median of {a.steps} steps\n")
    print("| context | cache | ms / token | tokens/s | vs the default cache | cache MiB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['context']} | {r['cache']} | {r['ms']:.1f} | {r['tokens_per_s']:.1f} | "
              f"{r['speedup']:.2f}× | {r['cache_MiB']:.0f} |")


if __name__ == "__main__":
    main()
