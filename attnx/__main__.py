"""Command line: ``python -m attnx [info|demo|bench]``.

* ``python -m attnx`` (or ``info``): version, build, instruction set, threads,
  then the demo.
* ``python -m attnx demo``: attention over the seeds' sentence, checked
  against the float64 reference; exits 1 if it does not match.
* ``python -m attnx bench``: the speed benchmark (see ``--help``).
"""

from __future__ import annotations

import argparse
import platform
import sys

import numpy as np

SENTENCE = "The animal didn't cross the street because it was too tired"


def _info() -> None:
    import attnx
    from attnx import _attnx

    print(f"attnx {attnx.__version__} (numpy {np.__version__}, Python {platform.python_version()}, "
          f"{platform.machine()})")
    print(f"instruction set: {attnx.isa()} (available: {', '.join(_attnx.available_isas())}; "
          f"force one with ATTNX_ISA)")
    print(f"threads: {attnx.get_num_threads()} (ATTNX_NUM_THREADS or attnx.set_num_threads)")


def demo_inputs(d_model: int = 16, seed: int = 0):
    """Tokens of the seeds' sentence and small embeddings (L, d_model), float32.

    The embeddings are random, except that "it" is made close to "animal", so
    that the attention of "it" visibly lands on "animal" (the seeds' example
    of what attention resolves).
    """
    tokens = SENTENCE.split()
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((len(tokens), d_model)).astype(np.float32)
    x[tokens.index("it")] = x[tokens.index("animal")] + 0.3 * x[tokens.index("it")]
    return tokens, x


def _demo() -> int:
    import attnx

    tokens, x = demo_inputs()
    d = x.shape[1]
    out, w = attnx.scaled_dot_product_attention(x, x, x, need_weights=True)
    ref_out, ref_w = attnx.reference(x, x, x, need_weights=True)
    err = max(float(np.max(np.abs(out - ref_out))), float(np.max(np.abs(w - ref_w))))
    ok = np.allclose(out, ref_out, atol=1e-5, rtol=5e-6) and np.allclose(w, ref_w, atol=1e-5, rtol=5e-6)

    print(f'\nself-attention over "{SENTENCE}"')
    print(f"Q = K = V = embeddings ({len(tokens)} tokens x {d}), scale 1/sqrt({d})")
    width = max(len(t) for t in tokens)
    print("weights of the query rows (each row sums to 1); columns are keys:")
    print(" " * (width + 1) + " ".join(f"{t[:5]:>5}" for t in tokens))
    for t, row in zip(tokens, w):
        print(f"{t:>{width}} " + " ".join(f"{p:5.2f}" for p in row))
    it = tokens.index("it")
    top = np.argsort(w[it])[::-1][:2]
    print(f'"it" attends most to: ' + ", ".join(f'"{tokens[j]}" ({w[it, j]:.2f})' for j in top))
    print(f"max |attnx - float64 reference| = {err:.2e} -> {'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m attnx",
        description="attnx: fast, exact masked multi-head attention for NumPy.")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("info", help="version, build, instruction set, threads (and the demo)")
    sub.add_parser("demo", help="attention over the seeds' sentence, checked against the reference")
    bench = sub.add_parser("bench", help="speed against PyTorch and the seeds' NumPy code")
    try:
        from . import _bench
    except ImportError:  # pragma: no cover
        _bench = None
    if _bench is not None:
        _bench.add_arguments(bench)
    args = parser.parse_args(argv)

    try:
        if args.command == "demo":
            return _demo()
        if args.command == "bench":
            if _bench is None:
                print("error: the benchmark is not available in this build", file=sys.stderr)
                return 2
            return _bench.run(args)
        _info()
        return _demo()
    except (ValueError, TypeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
