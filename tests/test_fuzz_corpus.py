"""Replays every input of the fuzzers' corpora through their harnesses.

Each corpus holds a few seeds (seed-*: inputs that reach interesting paths)
and every input that once made tools/fuzz.sh fail (crash-*, oom-*,
timeout-*):

* tests/fuzz/corpus/ for tests/fuzz/fuzz_sdpa.py (scaled_dot_product_attention
  and its gradients);
* tests/fuzz/corpus_api/ for tests/fuzz/fuzz_api.py (the backward from saved
  tensors, merge_attention, varlen_attention and its vjp, KVCache).

Each is decoded and checked exactly as the fuzzer does (the harness's
run_one), without atheris: a crash would end this process, a wrong answer or
an undocumented exception fails the test. An input that hits a bug listed in
its harness's KNOWN_BUGS is an expected failure until that bug is fixed.
"""

import importlib.util
import pathlib

import pytest

HERE = pathlib.Path(__file__).parent / "fuzz"


def _load(name, filename):
    spec = importlib.util.spec_from_file_location(name, HERE / filename)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _corpus(directory):
    d = HERE / directory
    return sorted(p for p in d.iterdir() if p.is_file()) if d.is_dir() else []


harness = _load("attnx_fuzz_sdpa", "fuzz_sdpa.py")
api_harness = _load("attnx_fuzz_api", "fuzz_api.py")
CORPUS = _corpus("corpus")
API_CORPUS = _corpus("corpus_api")
# (harness, file); fuzz_sdpa's entries keep their bare file names as test ids
CASES = [(harness, p) for p in CORPUS] + [(api_harness, p) for p in API_CORPUS]
IDS = [p.name for p in CORPUS] + ["api/" + p.name for p in API_CORPUS]


@pytest.mark.parametrize("files", [CORPUS, API_CORPUS], ids=["corpus", "corpus_api"])
def test_corpus_is_there(files):
    assert any(p.name.startswith("seed-") for p in files), "a fuzz corpus has no seed inputs"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_replay(case):
    h, path = case
    data = path.read_bytes()
    try:
        h.run_one(data)
    except Exception as exc:
        what = h.known_bug(exc)
        if what:
            pytest.xfail(f"known bug: {what}")
        raise AssertionError(f"{path.name} fails; it decodes to:\n{h.describe(data)}") from exc


def test_decoder_is_deterministic():
    # the corpus must mean the same thing on every run and machine
    data = bytes(range(7, 200, 3))
    assert harness.describe(data) == harness.describe(data)
    assert harness.Decoder(b"").int(3, 9) == 3   # exhausted input: the first choice


def test_api_harness_is_deterministic():
    # fuzz_api.py reads between its calls: the same input makes the same calls
    for mode in range(len(api_harness.MODES)):
        data = bytes([mode]) + bytes(range(7, 200, 3))
        assert api_harness.describe(data) == api_harness.describe(data)
