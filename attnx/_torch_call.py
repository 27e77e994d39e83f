"""attnx.torch's calls under a tracer (torch.compile, torch.export, fake and
functional tensors): scaled_dot_product_attention's arguments turned into
those of the operators' schemas (:mod:`attnx._torch_ops`), and the call."""

from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import numpy as np
import torch

from ._args import (CAUSAL, align_code, as_array, causal_code, check_dropout, check_flag,
                    check_layout, precision_code, real_number, window_value)
from . import _torch_ops as _ops

__all__ = ["call_operator"]


def _array_tensor(x: Any, name: str) -> Optional[torch.Tensor]:
    """An array argument of the operators (lengths, ALiBi slopes) as a tensor:
    a tensor as it is; anything else through attnx's own conversion (its errors
    named), or torch.as_tensor while compiling (a list traced as a constant)."""
    if x is None or isinstance(x, torch.Tensor):
        return x
    if torch.compiler.is_compiling():
        return torch.as_tensor(x)
    a = as_array(x, name)
    return torch.from_numpy(np.array(a, dtype=a.dtype.newbyteorder("=")))


def _float_or_none(x: object, name: str, what: str) -> Optional[float]:
    """A float option (scale, softcap) as the schema's ``float?``: a bad type
    raises attnx's TypeError naming it; the range is checked by the operator."""
    if x is None or type(x) is float:
        return x
    return real_number(x, name, what)


def _operator_options(opts: dict[str, Any]) -> Tuple[Any, ...]:
    """The options of the operators' schemas (their _OPTIONS) from
    scaled_dot_product_attention's keywords, each of a type the schema takes
    (a value the schema cannot hold raises attnx's error for it; the values
    themselves are checked by the NumPy functions the operators call)."""
    dropout_p = opts["dropout_p"]
    if type(dropout_p) is not float:
        check_dropout(dropout_p)
        dropout_p = float(dropout_p)
    causal = opts["is_causal"]
    causal_code_ = (CAUSAL[causal] if (causal is False or causal is True
                                       or (type(causal) is str and causal in CAUSAL))
                    else causal_code(causal))
    gqa = opts["enable_gqa"]
    if type(gqa) is not bool:
        gqa = check_flag(gqa, "enable_gqa")
    layout = opts["layout"]
    if type(layout) is not str:
        check_layout(layout)
    window = opts.get("window")
    if window is not None:
        w = window_value(window)
        window = None if w is None else [int(w[0]), int(w[1])]
    alignment = opts.get("alignment")
    if alignment is not None and type(alignment) is not str:
        align_code(alignment, causal_code_)
    precision = opts.get("precision", "highest")
    if type(precision) is not str:
        precision_code(precision)
    return (dropout_p, int(causal_code_), _float_or_none(opts.get("scale"), "scale", "a real number"),
            gqa, layout, window,
            _float_or_none(opts.get("softcap"), "softcap", "None or a real number > 0"),
            alignment, precision)


def call_operator(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any,
                   sinks: Optional[torch.Tensor], opts: dict[str, Any], need_weights: bool,
                   need_lse: bool) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Attention through ``torch.ops.attnx.scaled_dot_product_attention``
    (differentiable through its registered autograd; traced as one node by
    torch.compile and torch.export). Its float32 outputs come back in the
    query's dtype (no copy for float32: the output the backward reads is the
    one returned, saved once)."""
    mask, blocks = _ops.mask_tensors(attn_mask, query, key, opts["layout"])
    out, _, weights = _ops.forward(
        query, key, value, mask, blocks, sinks,
        _array_tensor(opts.get("key_lengths"), "key_lengths"),
        _array_tensor(opts.get("query_lengths"), "query_lengths"),
        _array_tensor(opts.get("alibi_slopes"), "alibi_slopes"),
        *_operator_options(opts), need_weights, need_lse)
    if need_weights:
        return out.to(query.dtype), weights.to(query.dtype)
    return out.to(query.dtype)
