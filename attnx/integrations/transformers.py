"""attnx as an attention implementation of Hugging Face transformers.

    import attnx.integrations.transformers
    attnx.integrations.transformers.register()          # once
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="attnx")
    # or, for a model already loaded: model.set_attn_implementation("attnx")

:func:`register` adds attnx's attention function to transformers'
``AttentionInterface`` and the boolean masks of ``"sdpa"`` to its
``AttentionMaskInterface`` under the same name, so models build the masks
attnx understands (True = may attend, the convention of both). The function
computes on CPU tensors through :func:`attnx.torch.scaled_dot_product_attention`,
so gradients flow (training, fine-tuning) to the queries, keys, values, a float
mask and the sinks. What models pass is handled: padding masks (bool and
additive float, 4-D), causal decoders with a KV cache (``generate()``), GQA,
``scaling``, ``softcap`` (Gemma 2), ``s_aux`` sinks (gpt-oss), sliding windows
(in the mask transformers builds, and as ``window=`` to skip the key tiles
outside it), ``position_bias`` (T5-style, added to the scores),
``output_attentions=True`` (the weights, computed by attnx). Dropout must be 0
while training (attnx has no dropout). ``register(precision="medium")`` lets
every attention call of the models use bfloat16 products (see
:func:`attnx.scaled_dot_product_attention`'s ``precision``).
transformers and torch are imported only here and by the private modules
behind it (``import attnx`` imports neither).
"""

from __future__ import annotations

from ._implementation import NAME, attention_forward, register
from ._cache import AttnxCache
from ._divergence import cache_divergence

__all__ = ["register", "attention_forward", "AttnxCache", "cache_divergence", "NAME"]
