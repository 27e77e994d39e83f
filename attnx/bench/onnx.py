"""ONNX Runtime as an optional contestant: its fused ``com.microsoft``
``MultiHeadAttention`` operator (flash attention on MLAS's GEMM kernels),
in a one-node graph on the CPU execution provider. Installed with the
``[onnx]`` extra; without it the rows simply have no ``onnxruntime`` column.

The operator takes queries, keys and values as (B, L, H·D) and gives (B, Lq,
H·Dv): its inputs are prepared in that layout before timing, as torch's are
prepared in its own, so neither contestant's time holds a copy."""

from __future__ import annotations

import importlib
from typing import Any, Callable, Optional

import numpy as np
from numpy.typing import NDArray

F32 = NDArray[np.float32]

# The graph's versions: an IR version that onnxruntime 1.17 and newer read
# (onnx may write a newer one by default), the default opset and Microsoft's.
IR_VERSION = 10
OPSET = 17


def load() -> Optional[Any]:
    """The onnxruntime module, or None when it (or onnx, which builds the
    graph) is not installed."""
    try:
        importlib.import_module("onnx")
        return importlib.import_module("onnxruntime")
    except ImportError:
        return None


def mha_graph(H: int, D: int, Dv: int, causal: bool) -> bytes:
    """A serialized model of one MultiHeadAttention node: q (B, Lq, H·D),
    k (B, Lk, H·D), v (B, Lk, H·Dv) -> out (B, Lq, H·Dv), scale 1/√D
    (the operator's default), ``causal``: its ``unidirectional`` mask (the
    upper-left triangle, as attnx's is_causal with Lq == Lk)."""
    helper = importlib.import_module("onnx.helper")
    TensorProto = importlib.import_module("onnx").TensorProto
    node = helper.make_node("MultiHeadAttention", ["q", "k", "v"], ["out"],
                            domain="com.microsoft", num_heads=H, unidirectional=int(causal))
    io = [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["B", f"L{name}", H * d])
          for name, d in (("q", D), ("k", D), ("v", Dv))]
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, ["B", "Lq", H * Dv])
    graph = helper.make_graph([node], "attention", io, [out])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = IR_VERSION
    data: bytes = model.SerializeToString()
    return data


def attention(ort: Any, q: F32, k: F32, v: F32, *, causal: bool, threads: int
              ) -> Callable[[], F32]:
    """A call of ONNX Runtime's attention on q (B, H, Lq, D), k (B, H, Lk, D),
    v (B, H, Lk, Dv) (float32, as attnx's "bhld"), on ``threads`` threads:
    the inputs moved to the operator's (B, L, H·D) once, here; the call
    returns its (B, Lq, H·Dv) output (:func:`to_bhld` gives attnx's layout)."""
    B, H, _, D = q.shape
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    session = ort.InferenceSession(mha_graph(H, D, v.shape[-1], causal), so,
                                   providers=["CPUExecutionProvider"])
    feed = {name: np.ascontiguousarray(x.transpose(0, 2, 1, 3).reshape(B, x.shape[2], -1))
            for name, x in (("q", q), ("k", k), ("v", v))}

    def call() -> F32:
        out: F32 = session.run(None, feed)[0]
        return out
    return call


def to_bhld(out: F32, H: int) -> F32:
    """The operator's (B, Lq, H·Dv) output as (B, H, Lq, Dv)."""
    B, L, HD = out.shape
    return out.reshape(B, L, H, HD // H).transpose(0, 2, 1, 3)
