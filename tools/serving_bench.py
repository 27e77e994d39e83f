"""Serving many requests on a CPU: transformers' continuous batching with attnx
against sdpa's, and against a static left-padded ``generate()``.

    python tools/serving_bench.py                      # the table of docs/guide/serving.md
    python tools/serving_bench.py --requests 8 --dtype float32 --layers 4   # quicker

A SmolLM2-135M-shaped Llama (30 layers, hidden 576, 9 query heads on 3
key/value heads, head_dim 64) with random weights, built from its config
(nothing downloaded). Prompts of random tokens, lengths uniform in
[--prompt-min, --prompt-max] (seeded); --new greedy tokens each (no EOS).
Each contestant runs in its own process (its peak RSS is its own), one after
the other, each process timing its generation alone (model built first):

* ``attnx CB``: ``generate_batch`` with attn_implementation="attnx";
* ``sdpa CB``: ``generate_batch`` with "sdpa";
* ``sdpa static``: ``generate()`` of the whole batch, left-padded, "sdpa";
* ``attnx static``: the same with "attnx".

Throughput: generated tokens (requests × --new) per second of wall time,
prefill included. Prints a Markdown table, and whether attnx's greedy tokens
equal sdpa's continuous batching (float32: they should).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from typing import Any, Dict, List

CONTESTANTS = ("attnx CB", "sdpa CB", "sdpa static", "attnx static")


def _config(layers: int) -> Any:
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                       num_hidden_layers=layers, num_attention_heads=9, num_key_value_heads=3,
                       head_dim=64, max_position_embeddings=8192, rope_theta=100000.0,
                       tie_word_embeddings=True)


def _prompts(n: int, lo: int, hi: int, seed: int = 0) -> List[List[int]]:
    import numpy as np
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 49152, int(L)).tolist() for L in rng.integers(lo, hi + 1, n)]


def run_one(name: str, a: argparse.Namespace) -> Dict[str, Any]:
    """One contestant in this process: its time, tokens and peak RSS."""
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    import attnx
    import attnx.integrations.transformers as tr
    torch.set_num_threads(a.threads)
    attnx.set_num_threads(a.threads)
    tr.register()
    torch.manual_seed(0)
    model = LlamaForCausalLM(_config(a.layers)).eval().to(getattr(torch, a.dtype))
    impl = name.split()[0]
    model.set_attn_implementation(impl)
    prompts = _prompts(a.requests, a.prompt_min, a.prompt_max)
    gc = GenerationConfig(max_new_tokens=a.new, min_new_tokens=a.new, do_sample=False,
                          eos_token_id=-1, pad_token_id=0)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    with torch.inference_mode():
        if name.endswith("CB"):
            pages = sum(-(-(len(p) + a.new) // a.page_size) for p in prompts) + len(prompts)
            cbc = ContinuousBatchingConfig(page_size=a.page_size, num_blocks=pages,
                                           max_batch_tokens=a.max_batch_tokens)
            out = model.generate_batch(inputs=prompts, generation_config=gc,
                                       continuous_batching_config=cbc, progress_bar=False)
            failed = {k: v.error for k, v in out.items() if v.error}
            if failed:
                raise RuntimeError(f"{name}: requests failed: {failed}")
            tokens = [out[f"req_{i}"].generated_tokens for i in range(len(prompts))]
        else:
            L = max(len(p) for p in prompts)
            ids = torch.tensor([[0] * (L - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
            res = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)
            tokens = res[:, L:].tolist()
    seconds = time.perf_counter() - t
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"name": name, "seconds": seconds, "tokens": tokens,
            "tokens_per_s": sum(len(x) for x in tokens) / seconds,
            "peak_rss_mib": rss / 1024, "rss_growth_mib": (rss - rss0) / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--prompt-min", type=int, default=128)
    ap.add_argument("--prompt-max", type=int, default=2048)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--page-size", type=int, default=256)
    ap.add_argument("--max-batch-tokens", type=int, default=2048)
    ap.add_argument("--only", nargs="+", choices=CONTESTANTS, default=list(CONTESTANTS))
    ap.add_argument("--one", choices=CONTESTANTS, help=argparse.SUPPRESS)
    ap.add_argument("--json", help="also write the results to this file")
    a = ap.parse_args()
    if a.one:
        a.requests, a.dtype = a.requests[0], a.dtype[0]
        print(json.dumps(run_one(a.one, a)))
        return
    rows = []
    base = [sys.executable, os.path.abspath(__file__), "--prompt-min", str(a.prompt_min),
            "--prompt-max", str(a.prompt_max), "--new", str(a.new), "--layers", str(a.layers),
            "--threads", str(a.threads), "--page-size", str(a.page_size),
            "--max-batch-tokens", str(a.max_batch_tokens)]
    for dtype in a.dtype:
        for n in a.requests:
            res = {}
            for name in a.only:
                r = subprocess.run(base + ["--one", name, "--requests", str(n), "--dtype", dtype],
                                   capture_output=True, text=True)
                if r.returncode:
                    sys.exit(f"{name} failed:\n{r.stderr[-3000:]}")
                res[name] = json.loads(r.stdout.strip().splitlines()[-1])
                print(f"  {dtype} {n} requests, {name}: {res[name]['tokens_per_s']:.1f} tokens/s "
                      f"({res[name]['seconds']:.1f} s, peak RSS {res[name]['peak_rss_mib']:.0f} MiB)",
                      file=sys.stderr)
            same = None
            if "attnx CB" in res and "sdpa CB" in res:
                x, y = res["attnx CB"]["tokens"], res["sdpa CB"]["tokens"]
                same = sum(p == q for u, v in zip(x, y) for p, q in zip(u, v)) / max(
                    sum(len(u) for u in x), 1)
            rows.append({"dtype": dtype, "requests": n, "results": res, "same_tokens": same})
    print(f"\n{a.layers} layers, prompts {a.prompt_min}-{a.prompt_max} tokens, {a.new} new each, "
          f"{a.threads} threads, pages of {a.page_size}, max_batch_tokens {a.max_batch_tokens}\n")
    names = [n for n in CONTESTANTS if n in a.only]
    print("| dtype | requests | " + " | ".join(f"{n} (tokens/s)" for n in names)
          + " | attnx CB / sdpa CB | attnx CB / sdpa static | same tokens as sdpa CB |")
    print("|---" * (len(names) + 5) + "|")
    for r in rows:
        res = r["results"]
        tps = {n: res[n]["tokens_per_s"] for n in names}

        def ratio(u: str, v: str) -> str:
            return f"{tps[u] / tps[v]:.2f}×" if u in tps and v in tps else "–"
        same = "–" if r["same_tokens"] is None else f"{100 * r['same_tokens']:.0f}%"
        print(f"| {r['dtype']} | {r['requests']} | " + " | ".join(f"{tps[n]:.1f}" for n in names)
              + f" | {ratio('attnx CB', 'sdpa CB')} | {ratio('attnx CB', 'sdpa static')} | {same} |")
    print("\npeak RSS (MiB): " + "; ".join(
        f"{r['dtype']} {r['requests']}: " + ", ".join(
            f"{n} {r['results'][n]['peak_rss_mib']:.0f}" for n in names) for r in rows))
    if a.json:
        for r in rows:
            for v in r["results"].values():
                v.pop("tokens")
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
