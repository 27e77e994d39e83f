"""``AttnxCache``: a transformers ``Cache`` whose layers keep keys and values
in :class:`attnx.KVCache` buffers (int8, bfloat16, float16 or float32), which
the "attnx" attention implementation reads in place.

A layer's ``update`` appends the new keys and values (quantized to int8 with a
scale a row, or rounded to the 16-bit dtype) and returns, instead of the whole
cache as torch tensors, placeholders of the right shapes that take no memory
(a zero expanded to (B, Hk, L, D)); :func:`layer_of` finds the layer behind
them, and ``attention_forward`` then computes with :meth:`KVCache.attend`.
Nothing is gathered or dequantized per step. Other attention implementations
would read the placeholders' zeros: ``update`` refuses to run under them.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .._kvcache import CACHE_DTYPES as DTYPES
from .._kvcache import KVCache, _cache_dtype


def _buffers(c: KVCache) -> List[np.ndarray]:
    """A cache's arrays along (batch, heads, tokens): k, v, and an int8 cache's
    scales and key centres (k_center: one row a sequence)."""
    return [a for a in (c.k, c.v, c.k_scale, c.v_scale, c.k_center) if a is not None]


def _numpy(x: torch.Tensor) -> np.ndarray:
    """A CPU tensor as a float32 (or float16) NumPy array, no copy for float32."""
    x = x.detach()
    if x.dtype not in (torch.float32, torch.float16):
        x = x.float()
    a: np.ndarray = x.cpu().numpy()
    return a


class AttnxLayer(CacheLayerMixin):  # type: ignore[misc]
    """One decoder layer's keys and values in a :class:`attnx.KVCache` that grows
    by doubling (``max_cache_len`` None) or is allocated once."""

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, dtype: str = "int8", max_cache_len: Optional[int] = None,
                 config: Any = None):
        super().__init__()
        self.dtype = dtype
        self.max_cache_len = max_cache_len
        self.config = config
        self.cache: Optional[KVCache] = None
        self.pending = False     # placeholders returned that attnx's attention has not read
        #: the last padding mask the attention checked, shared by the layers of one
        #: AttnxCache (they see the same mask each step: it is checked once a step);
        #: see attention_forward in attnx.integrations._implementation
        self.mask_memo: List[Any] = [None, None, None, None]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape
        self.device = key_states.device
        self.torch_dtype = key_states.dtype
        # the placeholders update returns: one zero, expanded (no memory), marked as ours
        self.keys = torch.zeros(1, 1, 1, 1, dtype=key_states.dtype)
        self.values = torch.zeros(1, 1, 1, 1, dtype=value_states.dtype)
        _PLACEHOLDERS[self.keys.data_ptr()] = self    # alive while self is: the address is ours
        # a centred int8 cache cannot softcap (the centre's shift cancels in a
        # softmax, not under tanh): Gemma 2's layers keep their keys uncentred
        center = not getattr(self._text_config(), "attn_logit_softcapping", None)
        self.cache = KVCache(B, H, self.max_cache_len or 256, D, value_dim=value_states.shape[-1],
                             dtype=self.dtype, center_keys=center)
        self.is_initialized = True

    def _text_config(self) -> Any:
        """The model's (decoder) text config, where its attention settings are."""
        text = self.config
        if hasattr(text, "get_text_config"):
            text = text.get_text_config(decoder=True)
        return text

    def _grow(self, need: int) -> None:
        """Room for ``need`` tokens: a cache twice as long (at least), the filled part copied."""
        old = self.cache
        assert old is not None
        if need <= old.max_len:
            return
        if self.max_cache_len is not None:
            raise ValueError(f"AttnxCache is full: {need} tokens need more than max_cache_len="
                             f"{self.max_cache_len}")
        new = KVCache(old.batch, old.heads, max(need, 2 * old.max_len), old.head_dim,
                      value_dim=old.value_dim, dtype=old.k.dtype,
                      center_keys=old.k_center is not None)
        L = int(old.lengths.max()) if old.batch else 0
        for to, frm in zip(_buffers(new), _buffers(old)):
            to[:, :, :L] = frm[:, :, :L]
        new.lengths[:] = old.lengths
        self.cache = new

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        """Append (B, Hk, n, D) keys and values; returns placeholders (B, Hk, L, D)
        that the "attnx" attention reads the cache behind."""
        impl = getattr(self._text_config(), "_attn_implementation", None)
        if self.pending or (impl is not None and not str(impl).startswith("attnx")):
            said = f"this model uses {impl!r}" if impl is not None and not str(impl).startswith(
                "attnx") else "the last keys it returned were not read by attnx's attention"
            raise ValueError(f"AttnxCache is read by the 'attnx' attention implementation only "
                             f"({said}): load the model with attn_implementation='attnx' after "
                             f"attnx.integrations.transformers.register()")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self.cache is not None
        n = key_states.shape[-2]
        self._grow(self.get_seq_length() + n)
        self.cache.append(_numpy(key_states), _numpy(value_states))
        self.pending = True
        B, H, L = self.cache.batch, self.cache.heads, self.get_seq_length()
        return (self.keys.expand(B, H, L, self.cache.head_dim),
                self.values.expand(B, H, L, self.cache.value_dim))

    def attend(self, query: torch.Tensor, options: Dict[str, Any]) -> torch.Tensor:
        """query (B, Hq, n, D) over the cache, lower-right causal: (B, Hq, n, Dv) float32."""
        assert self.cache is not None
        self.pending = False
        return torch.from_numpy(self.cache.attend(_numpy(query), **options))

    def get_mask_sizes(self, query_length: int) -> Tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        if self.cache is None or not self.cache.batch:
            return 0
        return int(self.cache.lengths[0])

    def get_max_length(self) -> int:
        return -1 if self.max_cache_len is None else self.max_cache_len

    def reset(self) -> None:
        self.pending = False
        if self.cache is not None:
            self.cache.lengths[:] = 0

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (transformers' convention: negative)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove; got "
                             f"{tokens_to_remove}")
        if self.cache is not None and tokens_to_remove:
            self.cache.lengths[:] = np.maximum(self.cache.lengths + tokens_to_remove, 0)

    def _select(self, index: np.ndarray) -> None:
        """Keep the batch rows ``index`` (in that order): a new cache."""
        old = self.cache
        if old is None:
            return
        new = KVCache(len(index), old.heads, old.max_len, old.head_dim, value_dim=old.value_dim,
                      dtype=old.k.dtype, center_keys=old.k_center is not None)
        for to, frm in zip(_buffers(new), _buffers(old)):
            to[...] = frm[index]
        new.lengths[:] = old.lengths[index]
        self.cache = new

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(beam_idx.cpu().numpy())

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.cache is not None:
            self._select(np.repeat(np.arange(self.cache.batch), repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.cache is not None:
            self._select(np.arange(self.cache.batch)[indices.cpu().numpy()])


#: each live layer by the address of its key placeholder's one element (views
#: made under torch.inference_mode() have no ``_base`` to find it by)
_PLACEHOLDERS: "weakref.WeakValueDictionary[int, AttnxLayer]" = weakref.WeakValueDictionary()


def layer_of(key: torch.Tensor) -> Optional[AttnxLayer]:
    """The AttnxLayer whose placeholder ``key`` is (a zero expanded: stride 0
    along every axis longer than 1, at the address of a live layer's
    placeholder), or None."""
    if key.dim() != 4 or any(st and n > 1 for st, n in zip(key.stride(), key.shape)):
        return None
    layer = _PLACEHOLDERS.get(key.data_ptr())
    if layer is None or layer.keys is None or layer.keys.data_ptr() != key.data_ptr():
        return None
    return layer


class AttnxCache(Cache):  # type: ignore[misc]
    """A transformers ``Cache`` for ``generate(past_key_values=...)`` whose keys
    and values live in attnx caches of ``dtype`` ("int8", "bfloat16",
    "float16" or "float32"), read in place by ``attn_implementation="attnx"``.

    An int8 cache holds int8 values and a float32 scale a (token, head) row: a
    quarter of float32's bytes, about half of bfloat16's (see
    :class:`attnx.KVCache`). ``max_cache_len``: allocate that many tokens
    once (None: grow by doubling). Decoder-only models with full attention
    (sliding-window layers are read with the window, the cache keeping every
    token); batches left-padded or not (the model's padding mask is passed on
    to :meth:`attnx.KVCache.attend`).

    >>> import torch, transformers
    >>> import attnx.integrations.transformers as tr
    >>> _ = tr.register()
    >>> cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2,
    ...     num_attention_heads=4, num_key_value_heads=2, intermediate_size=96)
    >>> model = transformers.LlamaForCausalLM(cfg).eval()    # random weights
    >>> model.set_attn_implementation("attnx")
    >>> cache = tr.AttnxCache(model.config, dtype="int8")
    >>> out = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False,
    ...                      past_key_values=cache, pad_token_id=0)
    >>> out.shape, cache.get_seq_length(), cache.layers[0].cache.k.dtype
    (torch.Size([1, 7]), 6, dtype('int8'))
    """

    def __init__(self, config: Any, dtype: str = "int8", max_cache_len: Optional[int] = None):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
        _cache_dtype(dtype)              # bfloat16 needs ml_dtypes: say so now
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        n = getattr(text, "num_hidden_layers", None)
        if not isinstance(n, int) or n < 1:
            raise ValueError("AttnxCache needs a decoder config with num_hidden_layers")
        layers = [AttnxLayer(dtype, max_cache_len, config) for _ in range(n)]
        memo: List[Any] = [None, None, None, None]
        for layer in layers:        # one mask a step for the whole model: checked once
            layer.mask_memo = memo
        super().__init__(layers=layers)
        self.dtype = dtype
