"""The benchmark's compute roofline: the FP32 FMA peak measured by the core
(attnx_fma_peak, kernels' fma_burn; the flop count is checked per ISA by the C
kernel test). Here: its Python entry point answers in GFLOP/s, on every ISA,
and refuses nonsense durations by name."""

import pytest

import attnx
from attnx import _attnx


def test_peak_is_a_positive_rate_on_every_isa(isa):
    one = _attnx.fma_peak(1, 0.03)
    assert isinstance(one, float) and one > 0.1       # even scalar code does 0.1 GFLOP/s
    assert _attnx.fma_peak(0, 0.03) > 0.1            # 0: attnx's thread count


@pytest.mark.parametrize("seconds", [0.0, -1.0, 61.0, float("nan")])
def test_peak_refuses_durations_outside_a_minute(seconds):
    with pytest.raises(ValueError, match="seconds"):
        _attnx.fma_peak(1, seconds)


def test_peak_takes_numbers_only():
    with pytest.raises(TypeError):
        _attnx.fma_peak("2", 0.1)
    assert attnx.get_num_threads() >= 1
