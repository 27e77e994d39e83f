"""A real model's speed with attn_implementation="attnx" against "sdpa".

    python tools/bench_llm.py                      # 1024 and 4096 tokens, float32 and bfloat16
    python tools/bench_llm.py --tokens 1024 --dtype bfloat16

A Llama-architecture decoder of SmolLM-135M's shape (hidden 576, 30 layers, 9
query and 3 key/value heads of 64, intermediate 1536, vocabulary 49152) built
from its config with random weights (nothing is downloaded), one prompt of
--tokens tokens: the prefill (one forward of the prompt, no cache), and one
greedy decoding step at that context (attnx.bench.models.decode_step: the cache
cropped back after each step), and greedy generate() of --new tokens with
both, whose tokens must be identical. The two
implementations are timed interleaved in one process (attnx.bench.context.interleaved:
blocks, pauses between contestants, medians of --rounds). Needs the [transformers] extra. Takes minutes at 4096 tokens.
"""

from __future__ import annotations

import argparse

import torch
import transformers

import attnx
from attnx.bench.context import interleaved as _time
from attnx.bench.models import decode_step
from attnx.integrations import transformers as hf

SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
             num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True)


def run(tokens: int, dtype: str, new: int, rounds: int) -> None:
    config = transformers.LlamaConfig(max_position_embeddings=8192, **SHAPE)
    models = {}
    for impl in ("attnx", "sdpa"):
        torch.manual_seed(0)
        m = transformers.LlamaForCausalLM(config.__class__(**config.to_dict())).eval()
        m.set_attn_implementation(impl)
        models[impl] = m.to(getattr(torch, dtype))
    ids = torch.randint(0, SHAPE["vocab_size"], (1, tokens), generator=torch.Generator().manual_seed(0))

    def prefill(m):
        def call():
            with torch.no_grad():
                return m(input_ids=ids)
        return call

    names = list(models)
    pre = dict(zip(names, _time([prefill(models[n]) for n in names], rounds)))
    dec = dict(zip(names, _time([decode_step(torch, models[n], ids) for n in names], rounds)))
    same = torch.equal(*(models[n].generate(input_ids=ids, max_new_tokens=new, do_sample=False)
                         for n in names))
    print(f"{tokens} tokens, {dtype}: prefill attnx {1e3 * pre['attnx']:.0f} ms, sdpa "
          f"{1e3 * pre['sdpa']:.0f} ms ({pre['sdpa'] / pre['attnx']:.2f}x); decoding attnx "
          f"{1e3 * dec['attnx']:.1f} ms/token, sdpa {1e3 * dec['sdpa']:.1f} "
          f"({dec['sdpa'] / dec['attnx']:.2f}x); greedy tokens identical: {same}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--new", type=int, default=8, help="tokens generated to compare")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    hf.register()
    torch.set_num_threads(a.threads)
    attnx.set_num_threads(a.threads)
    print(f"attnx {attnx.__version__}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}, {a.threads} threads, {attnx.isa()}")
    for tokens in a.tokens:
        for dtype in a.dtype:
            run(tokens, dtype, a.new, a.rounds)


if __name__ == "__main__":
    main()
