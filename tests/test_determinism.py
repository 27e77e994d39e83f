"""The same bits every time: repeated calls, any number of the core's threads
and concurrent Python threads; the ISA switch, and every ISA within the
accuracy bar of ``attnx.reference``."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import attnx
from attnx import _attnx
from conftest import assert_close, make_qkv, random_float_mask

sdpa = attnx.scaled_dot_product_attention
ref = attnx.reference


# --------------------------------------------------- bit-identical results

def test_repeated_calls_bit_identical(isa, rng):
    q, k, v = make_qkv(rng, B=(2,), Hq=2, Lq=67, Lk=131, E=33, Ev=17)
    mask = random_float_mask(rng, (67, 131), p_inf=0.1)
    first = sdpa(q, k, v, attn_mask=mask, is_causal="lower_right", need_weights=True)
    for _ in range(3):
        again = sdpa(q, k, v, attn_mask=mask, is_causal="lower_right", need_weights=True)
        np.testing.assert_array_equal(again[0], first[0])
        np.testing.assert_array_equal(again[1], first[1])


def test_thread_count_does_not_change_results(isa, rng):
    q, k, v = make_qkv(rng, B=(3,), Hq=3, Lq=70, Lk=90, E=32)
    before = _attnx.get_num_threads()
    assert before >= 1
    try:
        results = []
        for n in (1, 2, 3):
            _attnx.set_num_threads(n)
            assert _attnx.get_num_threads() == n
            results.append(sdpa(q, k, v, is_causal=True, need_weights=True))
    finally:
        _attnx.set_num_threads(before)
    assert _attnx.get_num_threads() == before
    for out, w in results[1:]:
        np.testing.assert_array_equal(out, results[0][0])
        np.testing.assert_array_equal(w, results[0][1])


def test_python_threads_agree(rng):
    problems = [make_qkv(rng, B=(2,), Hq=2, Lq=33 + i, Lk=40 + 3 * i, E=16 + i) for i in range(6)]
    serial = [sdpa(q, k, v, is_causal=True) for q, k, v in problems]
    barrier = threading.Barrier(6)

    def run(i):
        barrier.wait()
        q, k, v = problems[i]
        return [sdpa(q, k, v, is_causal=True) for _ in range(5)]

    with ThreadPoolExecutor(6) as ex:
        results = list(ex.map(run, range(6)))
    for i, outs in enumerate(results):
        for out in outs:
            np.testing.assert_array_equal(out, serial[i])


# ------------------------------------------------------------------ ISAs

def test_isa_api():
    avail = _attnx.available_isas()
    assert isinstance(avail, list) and "scalar" in avail
    assert set(avail) <= set(_attnx.ISA_NAMES)
    assert _attnx.isa() in avail
    assert attnx.isa() == _attnx.isa()
    current = _attnx.isa()
    with pytest.raises(ValueError):
        _attnx.set_isa("no-such-isa")
    assert _attnx.isa() == current


def test_isas_agree(rng):
    q, k, v = make_qkv(rng, B=(2,), Hq=2, Lq=19, Lk=37, E=33, Ev=17)
    mask = random_float_mask(rng, (19, 37))
    expected = ref(q, k, v, attn_mask=mask, is_causal="lower_right")
    previous = _attnx.isa()
    try:
        for name in _attnx.available_isas():
            _attnx.set_isa(name)
            assert_close(sdpa(q, k, v, attn_mask=mask, is_causal="lower_right"), expected,
                         err_msg=name)
    finally:
        _attnx.set_isa(previous)
