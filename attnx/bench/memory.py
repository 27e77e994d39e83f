"""The memory measurements: the peak resident set's growth during one call,
each in a fresh process (:func:`rss_growth`), for long sequences and for the
backward with a float mask."""

from __future__ import annotations

import subprocess
import sys
from typing import Tuple

import numpy as np

from .context import Context, inputs
from .rows import Row


def rss_growth(L: int, H: int, D: int, before: str, call: str, sizes: str) -> Tuple[float, float, int]:
    """Run ``before`` then, timed, ``call`` in a fresh process on q, k, v (and
    a dout ``do``), each (1, H, L, D): the peak RSS growth during ``call`` in
    MiB, its seconds, and the bytes of the arrays named by ``sizes``."""
    # The peak is Linux's VmHWM: ru_maxrss survives exec, so a child of a
    # process with torch loaded starts with the parent's peak (~260 MiB)
    # and a smaller call shows no growth at all.
    code = (
        "import resource, time, numpy as np, attnx\n"
        "def hwm():\n"
        "    try:\n"
        "        with open('/proc/self/status') as f:\n"
        "            return next(int(x.split()[1]) for x in f if x.startswith('VmHWM:'))\n"
        "    except (OSError, StopIteration):\n"
        "        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        f"rng = np.random.default_rng(0); L, H, D = {L}, {H}, {D}\n"
        "q, k, v, do = (rng.standard_normal((1, H, L, D), dtype=np.float32) for _ in range(4))\n"
        f"{before}\n"
        "base = hwm()\n"
        "t0 = time.perf_counter()\n"
        f"{call}\n"
        "t = time.perf_counter() - t0\n"
        "peak = hwm()\n"
        f"print(base, peak, t, {sizes})\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    base_kib, peak_kib, t, nbytes = res.stdout.split()
    return (int(peak_kib) - int(base_kib)) / 1024, float(t), int(nbytes)


def memory(ctx: Context, L: int, H: int, D: int) -> Row:
    """Peak RSS of one long-sequence call, in a fresh process."""
    extra, t, data = rss_growth(L, H, D, "pass", "out = attnx.scaled_dot_product_attention(q, k, v)",
                                "out.nbytes")
    row: Row = {"case": f"long L={L} H={H} D={D}", "threads": ctx.threads, "attnx_s": t,
                "attnx_gflops": 4.0 * H * L * L * D / t / 1e9, "peak_rss_growth_MiB": extra,
                "note": f"RSS grew {extra:.0f} MiB during the call, which allocates the "
                        f"{data / 2**20:.0f} MiB output (the inputs were allocated before)"}
    return row


def backward_memory(ctx: Context, L: int, H: int, D: int) -> Row:
    """Peak RSS growth of one long-sequence backward, in a fresh process."""
    extra, t, grads = rss_growth(
        L, H, D, "out, lse = attnx.scaled_dot_product_attention(q, k, v, return_lse=True)",
        "g = attnx.scaled_dot_product_attention_backward(do, q, k, v, out, lse)", "q.nbytes * 3")
    row: Row = {"case": f"long backward L={L} H={H} D={D}", "threads": ctx.threads,
                "attnx_s": t, "attnx_gflops": 10.0 * H * L * L * D / t / 1e9,
                "peak_rss_growth_MiB": extra,
                "note": f"RSS grew {extra:.0f} MiB during the call (the gradients are "
                        f"{grads / 2**20:.0f} MiB)"}
    return row


def mask_backward(ctx: Context, L: int, H: int, D: int, mshape: Tuple[int, ...]) -> Row:
    """The backward with a float mask of shape ``mshape`` (its gradient summed
    to that shape inside the backward) against the same call with the mask
    as bool: time (in this process, interleaved) and peak RSS growth (each
    in a fresh process)."""
    attnx = ctx.attnx
    attnx.set_num_threads(ctx.threads)
    q, k, v, dout = inputs(1, H, H, L, L, D) + inputs(1, H, H, L, L, D, seed=1)[:1]
    keep = np.random.default_rng(2).random(mshape) > 0.1
    masks = {"bool": keep, "float": np.where(keep, 0.0, -np.inf).astype(np.float32)}
    fns = []
    for m in masks.values():
        out, lse = attnx.scaled_dot_product_attention(q, k, v, attn_mask=m, return_lse=True)
        fns.append(lambda m=m, out=out, lse=lse: attnx.scaled_dot_product_attention_backward(
            dout, q, k, v, out, lse, attn_mask=m))
    t_bool, t_float = ctx.time(fns)
    rss = {}
    for kind in masks:
        # the mask made in place: a temporary would raise the peak before the call
        make = (f"m = np.{'ones' if kind == 'bool' else 'zeros'}({mshape}, "
                f"{'bool' if kind == 'bool' else 'np.float32'})\n"
                f"m[..., ::10] = {'False' if kind == 'bool' else '-np.inf'}")
        rss[kind], _, _ = rss_growth(
            L, H, D, make + "\nout, lse = attnx.scaled_dot_product_attention(q, k, v, "
            "attn_mask=m, return_lse=True)",
            "g = attnx.scaled_dot_product_attention_backward(do, q, k, v, out, lse, attn_mask=m)",
            "0")
    mask_mib = masks["float"].nbytes / 2**20
    row: Row = {"case": f"backward, float mask {mshape} vs bool, L={L} H={H} D={D}",
                "threads": ctx.threads, "attnx_s": t_float,
                "attnx_gflops": 10.0 * H * L * L * D / t_float / 1e9,
                "float_vs_bool_time": t_float / t_bool,
                "rss_growth_float_MiB": rss["float"], "rss_growth_bool_MiB": rss["bool"],
                "note": f"{t_float / t_bool:.2f}x the bool mask's time; RSS grew "
                        f"{rss['float']:.0f} MiB (bool {rss['bool']:.0f}, the mask "
                        f"{mask_mib:.1f} MiB; target: bool + mask + 8 MiB)"}
    attnx.set_num_threads(0)
    return row
