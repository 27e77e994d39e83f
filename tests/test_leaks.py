"""No leaks, and no crash when memory runs out.

* Reference counts of every argument (inputs, views and their bases, masks,
  lengths) are unchanged over thousands of calls, on the success paths and
  on the error paths of the public API and of the private ``_attnx.forward``;
  results hold no extra reference.
* Memory that NumPy allocates (traced by tracemalloc, which sees array data)
  and the resident set size of a fresh process stay flat over a long loop of
  mid-size calls: a leaked output, weights array or scratch buffer per call
  would add hundreds of MiB.
* A request for more memory than exists raises MemoryError (or NumPy's
  ValueError "array is too big"), never crashes: weights of more bytes than
  RAM + swap, an output that large for a broadcast (zero-stride) query, and
  the C core's own scratch allocation failing (run under an address-space
  limit, so it fails the same way on any machine), with one and with two
  threads (a helper thread's scratch failing after the caller's succeeded);
  the process computes normally afterwards. These run in a subprocess, so a
  crash fails the test instead of ending the test run.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
import tracemalloc

import numpy as np
import pytest

import attnx
from attnx import _attnx
from conftest import under_asan

sdpa = attnx.scaled_dot_product_attention

N_CALLS = 2000


# ASan's quarantine keeps freed memory resident and its shadow memory makes an
# address-space limit meaningless: the RSS and RLIMIT_AS tests skip there
# (ASan's own checks cover that ground).
asan_skip = pytest.mark.skipif(under_asan(), reason="under AddressSanitizer (see conftest.under_asan)")


def _refcounts(objs):
    gc.collect()
    return [sys.getrefcount(o) for o in objs]


def _inputs(seed=0, B=2, H=4, Lq=9, Lk=13, E=8, Ev=8):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, Lq * 2, E), dtype=np.float32)[:, :, ::-2]   # a negative-stride view
    k = rng.standard_normal((B, Lk, H, E), dtype=np.float32).swapaxes(1, 2)    # a transposed view
    v = rng.standard_normal((B, H, Lk, Ev))                                     # float64: converted
    return q, k, v, rng


def test_refcounts_success_paths():
    q, k, v, rng = _inputs()
    qb = q[:, :, :2]                                       # (B, H, 2, E) for lower-right causal
    bmask = rng.random((9, 13)) < 0.7
    fmask = rng.standard_normal((2, 1, 9, 13)).astype(np.float32)
    f16mask = rng.standard_normal((1, 13)).astype(np.float16)
    kl, ql = np.array([13, 4]), np.array([9, 0], np.int32)
    k2, v2 = k[:, :2], v[:, :2]                            # GQA: 2 key/value heads for 4 query heads
    q3, k3, v3 = q[0], k[0], v[0]                          # 3-D
    q2, k2d, v2d = q[0, 0], k[0, 0], v[0, 0]               # 2-D
    kl3 = np.array([13, 1, 0, 7])
    qbl, kbl, vbl = (np.ascontiguousarray(a.swapaxes(1, 2)) for a in (q, k, v))   # "blhd"
    scale = 0.25
    objs = [q, q.base, k, k.base, v, qb, bmask, fmask, f16mask, kl, ql, k2, v2, q3, k3, v3,
            q2, k2d, v2d, kl3, qbl, kbl, vbl, scale]
    calls = [
        lambda: sdpa(q, k, v),
        lambda: sdpa(q, k, v, attn_mask=bmask, key_lengths=kl, query_lengths=ql, need_weights=True),
        lambda: sdpa(q, k, v, fmask, 0.0, True, scale),
        lambda: sdpa(qb, k, v, attn_mask=f16mask, is_causal="lower_right", need_weights=True),
        lambda: sdpa(q, k2, v2, enable_gqa=True, key_lengths=kl),
        lambda: sdpa(q3, k3, v3, key_lengths=kl3, need_weights=True),
        lambda: sdpa(q2, k2d, v2d, attn_mask=bmask, scale=scale),
        lambda: sdpa(qbl, kbl, vbl, layout="blhd", key_lengths=kl, need_weights=True),
        lambda: attnx.reference(q, k, v, attn_mask=bmask),
    ]
    for c in calls:                      # warm up: caches, the thread pool, lazy imports
        c()
    before = _refcounts(objs)
    results = None
    for i in range(N_CALLS):
        results = calls[i % len(calls)]()
    after = _refcounts(objs)
    assert after == before, [(i, b, a) for i, (b, a) in enumerate(zip(before, after)) if a != b]
    del results
    out = sdpa(q, k, v)
    assert sys.getrefcount(out) == 2, "the result holds an extra reference"
    out, w = sdpa(q, k, v, need_weights=True)
    assert sys.getrefcount(out) == 2 and sys.getrefcount(w) == 2


def _public_errors(q, k, v):
    bad_mask = np.ones((9, 12), bool)
    int_mask = np.ones((9, 13), np.int32)
    kl_big, kl_neg = np.array([14, 1]), np.array([-1, 1])
    kl_float = np.array([1.0, 2.0])
    k_gqa = k[:, :3]
    return [
        (lambda: sdpa(q, k, v, attn_mask=bad_mask), ValueError),
        (lambda: sdpa(q, k, v, attn_mask=int_mask), TypeError),
        (lambda: sdpa(q, k, v, key_lengths=kl_big), ValueError),
        (lambda: sdpa(q, k, v, query_lengths=kl_neg), ValueError),
        (lambda: sdpa(q, k, v, key_lengths=kl_float), TypeError),
        (lambda: sdpa(q, k_gqa, v[:, :3], enable_gqa=True), ValueError),
        (lambda: sdpa(q, k[..., :3], v), ValueError),
        (lambda: sdpa(q.astype(np.int32), k, v), TypeError),
        (lambda: sdpa(q, k, v, scale=float("nan")), ValueError),
        (lambda: sdpa(q, k, v, is_causal="sideways"), ValueError),
        (lambda: sdpa(q, k, v, dropout_p=0.1), ValueError),
        (lambda: sdpa(q, k, v, layout="hlbd"), ValueError),
        (lambda: sdpa(q[0, 0, 0], k, v), ValueError),
    ], [bad_mask, int_mask, kl_big, kl_neg, kl_float, k_gqa]


def _forward_errors(q, k, v):
    q4 = np.ascontiguousarray(q)
    k4 = np.ascontiguousarray(k)
    v4 = np.ascontiguousarray(v, dtype=np.float32)
    out = np.zeros((2, 4, 9, 8), np.float32)
    w = np.zeros((2, 4, 9, 13), np.float32)
    m = np.ones((2, 4, 9, 13), bool)
    kl = np.full((2, 4), 13, np.int64)
    kl_bad = np.full((2, 4), 14, np.int64)
    m_bad = np.ones((2, 4, 9, 12), bool)
    ro = np.zeros_like(out)
    ro.flags.writeable = False
    f = _attnx.forward
    return [
        (lambda: f(q4, k4, v4, out, w, m_bad, kl, None, 0, 0.5), ValueError),
        (lambda: f(q4, k4, v4, out, w, m, kl_bad, None, 0, 0.5), ValueError),
        (lambda: f(q4, k4, v4, out, w, m, kl, kl_bad, 0, 0.5), ValueError),
        (lambda: f(q4, k4, v4, ro, w, m, kl, None, 0, 0.5), ValueError),
        (lambda: f(q4, k4, v4, out, w, m, kl, None, 5, 0.5), ValueError),
        (lambda: f(q4, k4, v4, out, w, m, kl, None, 0, float("inf")), ValueError),
        (lambda: f(q4, k4, v4.astype(np.float64), out, w, m, kl, None, 0, 0.5), TypeError),
        (lambda: f(q4, k4, v4, out, w, m.astype(np.int8), kl, None, 0, 0.5), TypeError),
        (lambda: f(q4, k4, v4, out, w, m, kl.astype(np.int32), None, 0, 0.5), TypeError),
        (lambda: f(q4, k4, v4, out, w, m, kl, None, "x", 0.5), TypeError),
        (lambda: f(q4, k4[:, :3], v4[:, :3], out, w, m, kl, None, 0, 0.5), ValueError),
    ], [q4, k4, v4, out, w, m, kl, kl_bad, m_bad, ro]


@pytest.mark.parametrize("which", ["public", "forward"])
def test_refcounts_error_paths(which):
    q, k, v, _ = _inputs()
    cases, extra = (_public_errors if which == "public" else _forward_errors)(q, k, v)
    objs = [q, q.base, k, k.base, v] + extra
    for c, exc in cases:                 # warm up, and every case does raise what it should
        with pytest.raises(exc):
            c()
    before = _refcounts(objs)
    for i in range(N_CALLS):
        c, exc = cases[i % len(cases)]
        try:
            c()
        except exc:
            pass
        else:
            pytest.fail(f"case {i % len(cases)} did not raise {exc.__name__}")
    after = _refcounts(objs)
    assert after == before, [(i, b, a) for i, (b, a) in enumerate(zip(before, after)) if a != b]


def test_traced_memory_flat():
    """NumPy reports its array data to tracemalloc: arrays that are never
    freed (an output or weights array kept alive by a stray reference) show
    up as traced memory that grows with the number of calls."""
    q, k, v, rng = _inputs(B=2, H=4, Lq=64, Lk=96, E=32, Ev=32)
    mask = rng.random((64, 96)) < 0.8
    kl = np.array([96, 50])

    def call(i):
        return sdpa(q, k, v, attn_mask=mask, key_lengths=kl, need_weights=bool(i % 2))

    for i in range(50):
        call(i)
    gc.collect()
    tracemalloc.start()
    try:
        for i in range(20):
            call(i)
        gc.collect()
        base = tracemalloc.get_traced_memory()[0]
        for i in range(N_CALLS // 2):
            call(i)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    # one leaked output per call would be 1000 * 64 KiB = 62 MiB
    assert grown < 256 * 1024, f"traced memory grew by {grown / 1024:.0f} KiB over {N_CALLS // 2} calls"


def _run_child(code, timeout=240, env=None):
    """Run ``code`` in a fresh interpreter; its last stdout line is JSON."""
    e = dict(os.environ, **(env or {}))
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                       text=True, timeout=timeout, env=e)
    assert r.returncode == 0, (
        f"child exited with {r.returncode} (negative: killed by a signal)\n"
        f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


RSS_CHILD = r"""
import json, os, sys
import numpy as np
import attnx

PAGE = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE

rng = np.random.default_rng(0)
B, H, L, E = 2, 4, 128, 64
q = rng.standard_normal((B, H, L, E), dtype=np.float32)
k = rng.standard_normal((B, L, H, E), dtype=np.float32).swapaxes(1, 2)
v = rng.standard_normal((B, H, L, E)).astype(np.float16)
mask = rng.standard_normal((1, H, L, L)).astype(np.float32)
kl = np.array([L, 77])
bad = np.ones((L, L - 1), bool)
def call(i):
    kind = i % 4
    if kind == 0:
        return attnx.scaled_dot_product_attention(q, k, v, attn_mask=mask, key_lengths=kl,
                                                  need_weights=True)
    if kind == 1:
        return attnx.scaled_dot_product_attention(q, k, v, is_causal=True)
    if kind == 2:
        return attnx.scaled_dot_product_attention(q[:, :, :1], k, v, is_causal="lower_right")
    try:
        attnx.scaled_dot_product_attention(q, k, v, attn_mask=bad)
    except ValueError:
        pass

n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
for i in range(300):
    call(i)
r0 = rss()
samples = []
for i in range(n):
    call(i)
    if i % 250 == 249:
        samples.append(rss() - r0)
print(json.dumps({"start": r0, "growth": rss() - r0, "samples": samples,
                  "threads": attnx.get_num_threads()}))
"""


@asan_skip
def test_resident_memory_flat():
    """2000 mid-size calls (weights, causal, decoding split-K, an error path)
    in a fresh process: the resident set grows by less than 4 MiB once warm."""
    res = _run_child(RSS_CHILD)
    mib = res["growth"] / 2 ** 20
    assert mib < 4, f"resident memory grew {mib:.1f} MiB over {N_CALLS} calls; samples {res['samples']}"


def _memory_facts():
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        with open("/proc/sys/vm/overcommit_memory") as f:
            overcommit = int(f.read())
    except OSError:
        return None, None
    return info["MemTotal"] + info.get("SwapTotal", 0), overcommit


HUGE_CHILD = r"""
import json, sys
import numpy as np
import attnx

total = int(sys.argv[1])
res = {}
def attempt(name, fn):
    try:
        fn()
        res[name] = "no error"
    except (MemoryError, ValueError) as e:
        res[name] = type(e).__name__ + ": " + str(e)[:120]

# weights (B, H, Lq, Lk) float32 of about 4x RAM + swap, from tiny inputs
n = 1
while 4 * n * n < 4 * total:
    n *= 2
q = np.ones((1, 1, n, 1), np.float32)
attempt("weights", lambda: attnx.scaled_dot_product_attention(q, q, q, need_weights=True))
# an output that large: a broadcast query (zero stride) of n*n rows, no copy of it
qb = np.broadcast_to(np.ones((1, 1, 1, 4), np.float32), (1, 1, n * n // 4, 4))
kv = np.ones((1, 1, 3, 4), np.float32)
attempt("output", lambda: attnx.scaled_dot_product_attention(qb, kv, kv))
# weights whose byte count does not fit in a C integer (8 queries, 2**60 broadcast
# keys): NumPy's ValueError "array is too big"
one = np.ones((1, 1, 1, 1), np.float32)
qb, kb = np.broadcast_to(one, (1, 1, 8, 1)), np.broadcast_to(one, (1, 1, 2 ** 60, 1))
attempt("too big", lambda: attnx.scaled_dot_product_attention(qb, kb, kb, need_weights=True))
# still computes afterwards
x = np.random.default_rng(0).standard_normal((2, 3, 5, 8)).astype(np.float32)
res["after"] = float(np.abs(attnx.scaled_dot_product_attention(x, x, x)
                            - attnx.reference(x, x, x)).max())
print(json.dumps(res))
"""


def test_more_memory_than_exists():
    total, overcommit = _memory_facts()
    if total is None:
        pytest.skip("no /proc/meminfo")
    if overcommit == 1:
        pytest.skip("vm.overcommit_memory=1: any allocation succeeds and the kernel "
                    "kills the process when the pages are touched")
    r = subprocess.run([sys.executable, "-c", HUGE_CHILD, str(total)], capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, f"child died ({r.returncode}):\n{r.stderr[-3000:]}"
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["weights"].startswith("MemoryError"), res
    assert res["output"].startswith("MemoryError"), res
    assert res["too big"].startswith(("MemoryError", "ValueError")), res
    assert res["after"] < 1e-5


SCRATCH_CHILD = r"""
import json, resource, sys
import numpy as np
import attnx
from attnx import _attnx

threads, heads = int(sys.argv[1]), int(sys.argv[2])
attnx.set_num_threads(threads)
x = np.random.default_rng(0).standard_normal((2, heads, 128, 32)).astype(np.float32)
attnx.scaled_dot_product_attention(x, x, x)            # warm: the thread pool exists (> 2 MFLOP)
# queries of a huge head dimension D and one key each: the core's scratch is
# about (D + 256) x 64 floats per thread, 64x the input
D = 4 * 2 ** 20
q = np.ones((1, heads, 1, D), np.float32)
v = np.ones((1, heads, 1, 1), np.float32)
out = np.zeros((1, heads, 1, 1), np.float32)
scratch = 64 * 4 * D                                   # one thread's, about 1 GiB
def vm():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()
# room for one thread's scratch but not for two
limit = vm() + int(1.5 * scratch) if threads > 1 else vm() + scratch // 2
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
resource.setrlimit(resource.RLIMIT_AS, (limit, hard))     # the soft limit only: restorable
res = {}
try:
    _attnx.forward(q, q, v, out, None, None, None, None, 0, 1.0)
    res["forward"] = "ok"
    res["out"] = out.ravel().tolist()
except MemoryError as e:
    res["forward"] = "MemoryError: " + str(e)
    res["out_untouched"] = bool((out == 0).all())
resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
res["after"] = float(np.abs(attnx.scaled_dot_product_attention(x, x, x)
                            - attnx.reference(x, x, x)).max())
print(json.dumps(res))
"""


@asan_skip
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc and RLIMIT_AS")
@pytest.mark.parametrize("threads,heads", [(1, 1), (2, 2)])
def test_core_scratch_allocation_failure(threads, heads):
    """The C core's own allocation failing (under an address-space limit) is a
    MemoryError: with one thread the caller's scratch fails; with two, the
    helper's fails after the caller's succeeded (its cleanup path)."""
    res = _run_child(SCRATCH_CHILD.replace("sys.argv[1]", repr(str(threads)))
                     .replace("sys.argv[2]", repr(str(heads))))
    if threads == 1:
        assert res["forward"].startswith("MemoryError"), res
    # with two threads: a MemoryError, or (if the core ever stops giving each
    # thread its own scratch) the right answer; never a crash
    if res["forward"] == "ok":
        assert res["out"] == [1.0] * heads, res
    else:
        assert res["forward"].startswith("MemoryError") and res["out_untouched"], res
    assert res["after"] < 1e-5, res
