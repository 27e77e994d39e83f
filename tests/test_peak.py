"""The benchmark's compute rooflines, measured by the core (attnx_peak, the
kernels' fma_burn, bf16dot_burn and amx_burn; their flop counts and sums are
checked per ISA by the C kernel test). Here: the Python entry point answers
in GFLOP/s for the units the kernels in use have and None for the others,
on every ISA, and refuses unknown units and nonsense durations by name."""

import pytest

import attnx
from attnx import _attnx


def test_the_units_are_the_cores_list():
    assert _attnx.PEAK_UNITS == ("fma", "bf16dot", "amx")


def test_fma_peak_is_a_positive_rate_on_every_isa(isa):
    one = _attnx.peak("fma", 1, 0.03)
    assert isinstance(one, float) and one > 0.1       # even scalar code does 0.1 GFLOP/s
    assert _attnx.peak("fma", 0, 0.03) > 0.1         # 0: attnx's thread count


def test_dot_peaks_exist_where_the_kernels_have_the_unit(isa):
    dots = _attnx.bf16_dots()      # None, "avx512_bf16", "amx" or "amx_emulated"
    bf16dot, amx = (_attnx.peak(u, 1, 0.03) for u in ("bf16dot", "amx"))
    assert (bf16dot is None) == (dots is None)
    assert (amx is None) == (dots is None or not dots.startswith("amx"))
    for p in (bf16dot, amx):
        assert p is None or (isinstance(p, float) and p > 0.0)


@pytest.mark.parametrize("seconds", [0.0, -1.0, 61.0, float("nan")])
def test_peak_refuses_durations_outside_a_minute(seconds):
    with pytest.raises(ValueError, match="seconds"):
        _attnx.peak("fma", 1, seconds)


def test_peak_refuses_unknown_units_naming_the_known():
    with pytest.raises(ValueError, match="'fma', 'bf16dot', 'amx'; got 'fp64'"):
        _attnx.peak("fp64", 1, 0.1)


def test_peak_takes_numbers_only():
    with pytest.raises(TypeError):
        _attnx.peak("fma", "2", 0.1)
    assert attnx.get_num_threads() >= 1
