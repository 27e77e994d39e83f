"""Replays every input in tests/fuzz/corpus/ through the fuzz harness.

The corpus holds a few seeds (seed-*: inputs that reach interesting paths)
and every input that once made tools/fuzz.sh fail (crash-*, oom-*,
timeout-*). Each is decoded and checked exactly as the fuzzer does
(tests/fuzz/fuzz_sdpa.py: run_one), without atheris: a crash would end this
process, a wrong answer or an undocumented exception fails the test. An input
that hits a bug listed in the harness's KNOWN_BUGS is an expected failure
until that bug is fixed.
"""

import importlib.util
import pathlib

import pytest

HERE = pathlib.Path(__file__).parent / "fuzz"
CORPUS = sorted(p for p in (HERE / "corpus").iterdir() if p.is_file()) if (HERE / "corpus").is_dir() else []


def _harness():
    spec = importlib.util.spec_from_file_location("attnx_fuzz_sdpa", HERE / "fuzz_sdpa.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


harness = _harness()


def test_corpus_is_there():
    assert any(p.name.startswith("seed-") for p in CORPUS), "tests/fuzz/corpus/ has no seed inputs"


@pytest.mark.parametrize("path", CORPUS, ids=[p.name for p in CORPUS])
def test_replay(path):
    data = path.read_bytes()
    try:
        harness.run_one(data)
    except Exception as exc:
        what = harness.known_bug(exc)
        if what:
            pytest.xfail(f"known bug: {what}")
        raise AssertionError(f"{path.name} fails; it decodes to:\n{harness.describe(data)}") from exc


def test_decoder_is_deterministic():
    # the corpus must mean the same thing on every run and machine
    data = bytes(range(7, 200, 3))
    assert harness.describe(data) == harness.describe(data)
    assert harness.Decoder(b"").int(3, 9) == 3   # exhausted input: the first choice
