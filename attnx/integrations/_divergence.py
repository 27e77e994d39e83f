"""How much a cache dtype changes a model's next-token distributions: KL
divergence and top-1 agreement against transformers' default cache, under
teacher forcing (``python -m attnx kv-divergence``)."""

from __future__ import annotations

import inspect
import os
from typing import Any, Dict, List, Sequence

import torch

from .._kvcache import CACHE_DTYPES as DTYPES
from ._implementation import register
from ._cache import AttnxCache


def _cache_kw(model: Any) -> str:
    """The name forward() gives the cache: "cache" (transformers 5.24 on) or
    "past_key_values" (5.23)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _decode_log_probs(model: Any, ids: torch.Tensor, prefill: int, steps: int,
                      cache: Any) -> torch.Tensor:
    """(steps, vocab) float64 log-probabilities of the decoding steps: the
    prompt ids[:, :prefill] in one call, then ids[:, prefill + i] one token a
    step, each predicting the next (teacher forcing)."""
    kw = _cache_kw(model)
    out: List[torch.Tensor] = []
    with torch.no_grad():
        res = model(ids[:, :prefill], use_cache=True, **{kw: cache})
        for t in range(prefill, prefill + steps):
            # the output names the cache as forward's argument does
            res = model(ids[:, t:t + 1], use_cache=True, **{kw: getattr(res, kw)})
            out.append(res.logits[0, -1].double().log_softmax(-1))
    return torch.stack(out)


def cache_divergence(model: Any, input_ids: Any, prefill: int = 256, steps: int = 384,
                     dtypes: Sequence[str] = ("int8", "bfloat16"),
                     ) -> Dict[str, Dict[str, float]]:
    """Each cache dtype's divergence from transformers' default cache.

    ``model`` a causal LM loaded with ``attn_implementation="attnx"`` (after
    :func:`register`); ``input_ids`` (1, n) or (n,) token ids, n >= prefill +
    steps. The first ``prefill`` tokens go in as one prompt, then ``steps``
    tokens one at a time (teacher forcing: the text's own tokens, whatever
    the model predicts), once with the default cache and once with
    ``AttnxCache(model.config, dtype)`` for each dtype of ``dtypes``
    ("int8", "bfloat16", "float16", "float32"). Returns, per dtype,
    ``{"kl": mean KL(default ‖ cache) over the steps' next-token
    distributions, "kl_max": the largest, "top1": the share of steps whose
    most likely token agrees}``.

    Example
    -------
    >>> import torch, transformers, attnx.integrations.transformers as tr
    >>> name = tr.register()
    >>> config = transformers.LlamaConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1,
    ...     num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)
    >>> torch.manual_seed(0) and None
    >>> model = transformers.LlamaForCausalLM(config).eval()
    >>> model.set_attn_implementation("attnx")
    >>> res = tr.cache_divergence(model, torch.randint(50, (1, 24)), prefill=16, steps=8,
    ...                           dtypes=["int8", "float32"])
    >>> res["float32"]["kl"] < 1e-9 < res["int8"]["kl"] < 1e-2, sorted(res["int8"])
    (True, ['kl', 'kl_max', 'top1'])
    """
    ids = torch.as_tensor(input_ids)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.shape[0] != 1:
        raise ValueError(f"input_ids must be (1, n) or (n,) token ids; got shape {tuple(ids.shape)}")
    if prefill < 1 or steps < 1:
        raise ValueError(f"prefill and steps must be positive; got prefill={prefill}, "
                         f"steps={steps}")
    if ids.shape[1] < prefill + steps:
        raise ValueError(f"the text has {ids.shape[1]} tokens; prefill={prefill} + steps={steps} "
                         f"need {prefill + steps}")
    for d in dtypes:
        if d not in DTYPES:
            raise ValueError(f"dtypes: each must be one of {', '.join(DTYPES)}; got {d!r}")
    base = _decode_log_probs(model, ids, prefill, steps, None)
    result: Dict[str, Dict[str, float]] = {}
    for d in dtypes:
        lp = _decode_log_probs(model, ids, prefill, steps, AttnxCache(model.config, dtype=d))
        kl = (base.exp() * (base - lp)).sum(-1).clamp_min(0)
        result[d] = {"kl": float(kl.mean()), "kl_max": float(kl.max()),
                     "top1": float((base.argmax(-1) == lp.argmax(-1)).double().mean())}
    return result


def load_model(model: str, gguf: bool) -> Any:
    """A causal LM and its tokenizer from a local directory (``from_pretrained``
    without the network) or a GGUF file (needs the gguf and accelerate
    packages), float32, with attnx's attention. The path is there: the CLI
    checks it before it imports torch."""
    import transformers

    register()
    kw: Dict[str, Any] = dict(local_files_only=True)
    where = model
    if gguf:
        where, kw["gguf_file"] = os.path.dirname(os.path.abspath(model)), os.path.basename(model)
    try:
        lm = transformers.AutoModelForCausalLM.from_pretrained(
            where, dtype=torch.float32, attn_implementation="attnx", **kw)
        tok = transformers.AutoTokenizer.from_pretrained(where, **kw)
    except ImportError as e:
        raise OSError(f"loading {model}: {e} (a GGUF file needs `pip install gguf accelerate`)"
                      ) from None
    return lm.eval(), tok
