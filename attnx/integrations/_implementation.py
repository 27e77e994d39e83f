"""attnx as transformers' ``attn_implementation``: :func:`attention_forward`,
what a model's attention layers call, and :func:`register`, which adds it to
transformers' interfaces. :mod:`attnx.integrations.transformers` hands both
on; ``_divergence`` (which that module also imports) registers through here,
so neither imports the other back."""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Tuple, cast

import torch

from .._args import Precision, precision_code
from ..torch import scaled_dot_product_attention as _attention
from ._cache import AttnxLayer, layer_of
from ._continuous_batching import check_version, varlen_forward
from ._continuous_batching import install as _install_continuous_batching

#: the name :func:`register` registers by default
NAME = "attnx"


def _mask_with_bias(mask: Optional[torch.Tensor], bias: torch.Tensor, causal: bool,
                    q_len: int, kv_len: int) -> torch.Tensor:
    """A position bias (B or 1, H, Lq, Lk) and the mask as one additive float mask."""
    if mask is None:
        if not causal:
            return bias
        keep = torch.ones(q_len, kv_len, dtype=torch.bool, device=bias.device).tril()
        return bias.masked_fill(~keep, float("-inf"))
    if mask.dtype == torch.bool:
        return bias.masked_fill(~mask, float("-inf"))
    return bias + mask


def _causal_mask(mask: torch.Tensor, q_len: int, kv_len: int, window: Any) -> bool:
    """Whether ``mask`` (..., q_len, kv_len), bool or additive, allows exactly the
    lower-right causal keys (within the window): checked 1024 query rows at a
    time, so a long prompt's mask needs no (q_len, kv_len) temporaries."""
    if mask.shape[-1] != kv_len or mask.shape[-2] != q_len:
        return False
    j = torch.arange(kv_len)[None, :]
    for r0 in range(0, q_len, 1024):
        rows = mask[..., r0:r0 + 1024, :]
        allowed = rows if rows.dtype == torch.bool else rows == 0
        i = torch.arange(r0, r0 + rows.shape[-2])[:, None] + (kv_len - q_len)
        want = j <= i
        if window is not None:
            want &= j >= i - window[0]
        if not bool((allowed == want).all()):
            return False
    return True


def _cached_forward(layer: AttnxLayer, query: torch.Tensor, attention_mask: Optional[torch.Tensor],
                    options: dict[str, Any], need_weights: bool,
                    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Attention over an AttnxCache layer read in place: lower-right causal and
    the window, and the model's mask too (a left-padded batch's) when it says
    more than that."""
    assert layer.cache is not None
    q_len, kv_len = query.shape[2], layer.get_seq_length()
    window = options.get("window")
    if attention_mask is not None:
        # The layers of one AttnxCache share a memo (the last mask, held so that its
        # identity cannot be reused, its window and key count, and what to pass on:
        # None when it says no more than lower-right causal within the window, else
        # the mask as a NumPy array): the mask is checked and converted once a step.
        # It belongs to the cache, not the module: threads generating with caches
        # of their own never see each other's masks.
        memo = layer.mask_memo
        if not (memo[0] is attention_mask and memo[1] == window and memo[2] == kv_len):
            extra = None
            if not _causal_mask(attention_mask, q_len, kv_len, window):
                m = attention_mask.detach().cpu()
                extra = (m if m.dtype == torch.bool else m.float()).numpy()
            memo = [attention_mask, window, kv_len, extra]
            layer.mask_memo[:] = memo
        if memo[3] is not None:
            options = dict(options, attn_mask=memo[3])
    q = query.detach().float().cpu().numpy()
    weights = None
    layer.pending = False            # its placeholders are read, as they must be
    if need_weights:
        out, weights = layer.cache.attend(q, need_weights=True, **options)
    else:
        out = layer.cache.attend(q, **options)
    o = torch.from_numpy(out).to(query.dtype).transpose(1, 2).contiguous()
    return o, None if weights is None else torch.from_numpy(weights).to(query.dtype)


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                      dropout: float = 0.0, scaling: Optional[float] = None,
                      is_causal: Optional[bool] = None, softcap: Optional[float] = None,
                      s_aux: Optional[torch.Tensor] = None,
                      position_bias: Optional[torch.Tensor] = None,
                      precision: Precision = "highest",
                      **kwargs: Any) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """transformers' attention function signature, computed by attnx.

    query (B, Hq, Lq, D), key (B, Hk, Lk, D), value (B, Hk, Lk, Dv) (Hq a
    multiple of Hk); attention_mask None, bool (True = may attend) or additive
    float, broadcastable to (B, Hq, Lq, Lk). Returns the output as transformers
    wants it, (B, Lq, Hq, Dv) contiguous, and the attention weights
    (B, Hq, Lq, Lk) when the model asks for them (``output_attentions=True``),
    else None. ``sliding_window`` (an int, as models pass it) also goes to the
    core as ``window=(sliding_window - 1, 0)`` for a prompt without a past.
    ``precision``: as in :func:`attnx.scaled_dot_product_attention` (set by
    :func:`register`).
    """
    layer = layer_of(key)
    if layer is not None:          # an AttnxCache's layer: its keys and values read in place
        if position_bias is not None or (dropout and module.training) or is_causal is False:
            raise ValueError("AttnxCache reads causal decoders' caches: no position_bias, "
                             "no attention dropout in training, no is_causal=False")
        sliding = kwargs.get("sliding_window")
        options: dict[str, Any] = dict(scale=scaling, softcap=softcap if softcap else None,
                                       precision=precision,
                                       window=(int(sliding) - 1, 0) if sliding else None)
        if s_aux is not None:
            options["sinks"] = s_aux.detach().float().numpy()
        return _cached_forward(layer, query, attention_mask, options,
                               bool(kwargs.get("output_attentions")))
    # continuous batching: requests packed along the queries, the cache's read_index
    # given (padding-free training also passes cu_seq_lens_*, and takes the path below)
    if "cu_seq_lens_q" in kwargs and "read_index" in kwargs:
        if kwargs.get("output_attentions"):
            raise ValueError("attnx: output_attentions=True is not available in continuous batching")
        sliding = kwargs.get("sliding_window")
        options = dict(is_causal="lower_right" if is_causal is not False else False,
                       scale=scaling, softcap=softcap if softcap else None, precision=precision,
                       window=(int(sliding) - 1, 0) if sliding else None)
        if s_aux is not None:
            options["sinks"] = s_aux.detach().float().numpy()
        return varlen_forward(module, query, key, value, kwargs, options), None
    if dropout and module.training:
        raise ValueError(f"attnx has no attention dropout: the model's attention dropout is "
                         f"{dropout} in training mode; set it to 0.0 in the config (or call "
                         f"model.eval()) to use attn_implementation='attnx'")
    need_weights = bool(kwargs.get("output_attentions"))
    q_len, kv_len = query.shape[2], key.shape[2]
    full_kv_len = kv_len
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    # As "sdpa": without a mask, a causal module's prefill is upper-left causal
    # (keys past the queries belong to an empty static cache), and one query
    # (decoding) sees every key.
    causal = causal and q_len > 1 and attention_mask is None
    if causal and kv_len > q_len:
        key, value = key[:, :, :q_len], value[:, :, :q_len]
        if position_bias is not None:
            position_bias = position_bias[..., :q_len]
        kv_len = q_len
    if position_bias is not None:
        attention_mask = _mask_with_bias(attention_mask, position_bias, causal, q_len, kv_len)
        causal = False
    # A sliding window (Mistral, Qwen2, Gemma 2's local layers) is in the mask
    # too; given as window= as well, the core skips the key tiles outside the
    # band instead of reading the mask there. Only where queries and keys are
    # the same positions (a prompt without a past): with a cache, the keys'
    # positions (a static cache's empty slots) are the mask's to say.
    sliding = kwargs.get("sliding_window")
    window = (int(sliding) - 1, 0) if sliding and q_len == kv_len else None
    res = _attention(query, key, value, attn_mask=attention_mask, is_causal=causal,
                     scale=scaling, enable_gqa=query.shape[1] != key.shape[1],
                     softcap=softcap if softcap else None, sinks=s_aux, window=window,
                     need_weights=need_weights, precision=precision)
    if not need_weights:
        return cast(torch.Tensor, res).transpose(1, 2).contiguous(), None
    out, weights = res
    if full_kv_len > kv_len:        # the empty slots of a static cache: weight 0, as "eager"
        weights = torch.nn.functional.pad(weights, (0, full_kv_len - kv_len))
    return out.transpose(1, 2).contiguous(), weights


def register(name: str = NAME, *, precision: Precision = "highest") -> str:
    """Register attnx with transformers under ``name`` (default "attnx"), a
    non-empty str (TypeError for another type, ValueError for "").

    After this, ``attn_implementation="attnx"`` works in ``from_pretrained``,
    ``from_config`` and ``model.set_attn_implementation``. Returns the name.
    ``precision`` ("highest" or "medium"): what every attention call of the
    models registered under ``name`` passes on (see
    :func:`attnx.scaled_dot_product_attention`); checked here. Calling it
    again is harmless; the last call's precision holds.

    It also lets ``name`` run transformers' continuous batching
    (``model.generate_batch``, ``init_continuous_batching``), each request
    attending to its own keys read in place from the paged cache (two small
    hooks, documented in ``attnx.integrations._continuous_batching``).
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str (the attn_implementation name); got "
                        f"{type(name).__name__} {name!r}")
    if not name:
        raise ValueError("name must be a non-empty str (the attn_implementation name); got ''")
    import transformers
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask
    check_version(transformers.__version__)
    precision_code(precision)
    forward: Callable[..., Tuple[torch.Tensor, Optional[torch.Tensor]]] = attention_forward
    if precision != "highest":
        forward = functools.wraps(attention_forward)(
            functools.partial(attention_forward, precision=precision))
    _install_continuous_batching(name)     # a supported release has what the hooks need
    AttentionInterface.register(name, forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
