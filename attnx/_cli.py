"""The command line, ``python -m attnx [info|demo|bench]`` (``__main__`` runs it).

* ``python -m attnx``: what ``info`` prints, then the demo (README's main job;
  exits 1 if the demo does not match the reference).
* ``python -m attnx info``: version, build (the extension, the instruction
  sets it can use here and the one in use), threads, optional extras, and a
  warning line for an ``ATTNX_ISA`` / ``ATTNX_NUM_THREADS`` that is ignored.
* ``python -m attnx demo``: self-attention over the sentence "The animal
  didn't cross the street because it was too tired", the weights printed as a table, checked against the float64 reference; exits 1 if it
  does not match.
* ``python -m attnx bench``: the speed benchmark (see ``--help``); ``--plot DIR``
  draws its results (the ``attnx.bench`` subpackage).

Mistakes on the command line print one ``error:`` line and exit 2, never a
traceback.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from typing import List, NoReturn, Optional, Sequence, Tuple

import numpy as np
from numpy.typing import NDArray

from . import _attnx
from .bench import cli as _bench
from .bench.rows import MissingExtra

SENTENCE = "The animal didn't cross the street because it was too tired"


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage block) and exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _env_warnings() -> List[str]:
    """Settings in the environment that the C core ignores (it falls back silently)."""
    warnings = []
    isa = os.environ.get("ATTNX_ISA")
    if isa and isa != _attnx.isa():
        available = _attnx.available_isas()
        why = ("is not available on this CPU" if isa in _attnx.ISA_NAMES else
               f"is not an instruction set (known: {', '.join(_attnx.ISA_NAMES)})")
        warnings.append(f"ATTNX_ISA={isa!r} {why}; using {_attnx.isa()} "
                        f"(available here: {', '.join(available)})")
    for name in ("ATTNX_NUM_THREADS", "OMP_NUM_THREADS"):
        value = os.environ.get(name)
        if not value:
            continue
        try:
            n = int(value)
        except ValueError:
            n = 0
        if not (0 < n <= _attnx.MAX_THREADS) or value != value.rstrip():
            warnings.append(f"{name}={value!r} is ignored by attnx: it must be an integer "
                            f"from 1 to {_attnx.MAX_THREADS}")
        if name == "ATTNX_NUM_THREADS" and 0 < n <= _attnx.MAX_THREADS:
            break   # takes precedence over OMP_NUM_THREADS
    return warnings


def _threads_source() -> str:
    for name in ("ATTNX_NUM_THREADS", "OMP_NUM_THREADS"):
        value = os.environ.get(name, "")
        try:
            if 0 < int(value) <= _attnx.MAX_THREADS and value == value.rstrip():
                return f"from {name}"
        except ValueError:
            pass
    return "one per CPU available to this process"


def _package_version(name: str) -> Optional[str]:
    """The installed version of ``name`` (without importing it), or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _info() -> None:
    import attnx

    print(f"attnx {attnx.__version__} (numpy {np.__version__}, "
          f"{platform.python_implementation()} {platform.python_version()}, "
          f"{platform.system()} {platform.machine()})")
    print(f"extension: {getattr(_attnx, '__file__', '(built in)')}")
    print(f"instruction set: {attnx.isa()} (available here: {', '.join(_attnx.available_isas())}; "
          f"force one with ATTNX_ISA)")
    print(f"threads: {attnx.get_num_threads()} ({_threads_source()}; "
          f"ATTNX_NUM_THREADS or attnx.set_num_threads change it)")
    extras = []
    for name, use in (("torch", "tests, bench, MultiHeadAttention.from_torch"),
                      ("matplotlib", "plot_attention")):
        v = _package_version(name)
        extras.append(f"{name} {v}" if v else f"{name} not installed ({use})")
    print("optional: " + "; ".join(extras))


def demo_inputs(d_model: int = 16, seed: int = 0) -> Tuple[List[str], NDArray[np.float32]]:
    """Tokens of SENTENCE and small embeddings (L, d_model), float32.

    The embeddings are random, except that "it" is made close to "animal", so
    that the attention of "it" visibly lands on "animal" (the classic example
    of what attention resolves: what does "it" refer to?).
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
    print('"it" attends most to: ' + ", ".join(f'"{tokens[j]}" ({w[it, j]:.2f})' for j in top))
    print(f"max |attnx - float64 reference| = {err:.2e} -> {'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1


def _kv_divergence(args: argparse.Namespace) -> int:
    """``python -m attnx kv-divergence``: a table of each cache dtype's KL and top-1."""
    # the arguments first: importing torch and transformers takes seconds
    from ._kvcache import CACHE_DTYPES
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in dtypes or [""]:
        if d not in CACHE_DTYPES:
            raise ValueError(f"--dtypes: each must be one of {', '.join(CACHE_DTYPES)}; "
                             f"got {d!r}")
    if args.gguf is not None and not os.path.isfile(args.gguf):
        raise OSError(f"--gguf: no such file: {args.gguf}")
    if args.gguf is None and not os.path.isdir(args.model):
        raise OSError(f"--model: no such directory: {args.model} (a local model directory; "
                      f"nothing is downloaded)")
    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    try:
        from .integrations._divergence import cache_divergence, load_model
    except ImportError as e:
        raise MissingExtra(f"kv-divergence needs torch and transformers (pip install "
                           f"'attnx[transformers]'): {e}") from None
    model, tok = load_model(args.gguf or args.model, gguf=args.gguf is not None)
    ids = tok(text, return_tensors="pt").input_ids
    res = cache_divergence(model, ids, args.prefill, args.steps, dtypes)
    print(f"{args.gguf or args.model}: {args.prefill}-token prompt, {args.steps} decoding steps "
          f"(teacher forcing), against transformers' default cache")
    print(f"{'cache dtype':<12} {'mean KL':>10} {'max KL':>10} {'top-1 agreement':>16}")
    for d, r in res.items():
        print(f"{d:<12} {r['kl']:>10.2e} {r['kl_max']:>10.2e} {r['top1'] * 100:>15.1f}%")
    return 0


def _parser() -> Tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    from . import __version__

    parser = _Parser(
        prog="python -m attnx",
        description="attnx: fast, exact masked multi-head attention for NumPy. Without a "
                    "command: what 'info' prints, then the demo.",
        epilog=f"environment: ATTNX_ISA={'|'.join(_attnx.ISA_NAMES)} forces an instruction "
               "set, ATTNX_NUM_THREADS (or OMP_NUM_THREADS) sets the thread count.")
    parser.add_argument("--version", action="version", version=f"attnx {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{info,demo,bench,kv-divergence}")
    sub.add_parser("info", description="Version, build (the instruction sets usable here and "
                   "the one in use), threads and optional extras.",
                   help="version, build, instruction set, threads")
    sub.add_parser("demo", description=f'Self-attention over "{SENTENCE}": the weights as '
                   "a table, checked against the float64 reference (exit 1 on a mismatch).",
                   help="attention over an example sentence, checked against the reference")
    bench = sub.add_parser("bench", description="attnx against PyTorch and the NumPy attention "
                           "tutorials teach: interleaved runs in one process, medians, ratios.",
                           help="speed against PyTorch and plain NumPy")
    _bench.add_arguments(bench)
    kl = sub.add_parser("kv-divergence", description="How much each cache dtype changes a "
                        "model's next-token distributions: mean KL divergence and top-1 "
                        "agreement against transformers' default cache, on a text, under "
                        "teacher forcing (needs attnx[transformers]).",
                        help="KL and top-1 agreement of the cache dtypes on your model")
    which = kl.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", metavar="DIR", help="a local model directory (from_pretrained)")
    which.add_argument("--gguf", metavar="FILE", help="a GGUF file (needs gguf and accelerate)")
    kl.add_argument("--text", metavar="FILE", required=True, help="the text to decode")
    kl.add_argument("--prefill", type=int, default=256, help="prompt tokens (default 256)")
    kl.add_argument("--steps", type=int, default=384, help="decoding steps (default 384)")
    kl.add_argument("--dtypes", default="int8,bfloat16",
                    help="cache dtypes, comma-separated (default int8,bfloat16)")
    return parser, bench


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    parser, bench_parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "bench":
        if args.threads < 0 or args.threads > _attnx.MAX_THREADS:
            bench_parser.error(f"argument --threads: must be from 1 to {_attnx.MAX_THREADS} "
                               f"(0: attnx's default); got {args.threads}")
        if args.repeats < 0:
            bench_parser.error(f"argument --repeats: must be a positive integer "
                               f"(0: the default); got {args.repeats}")
        if args.from_json and args.plot is None:
            bench_parser.error("argument --from-json: only with --plot DIR (it draws a saved "
                               "--json output)")

    for w in _env_warnings():
        print(f"warning: {w}", file=sys.stderr)
    try:
        if args.command == "demo":
            return _demo()
        if args.command == "info":
            _info()
            return 0
        if args.command == "bench":
            return _bench.run(args)
        if args.command == "kv-divergence":
            return _kv_divergence(args)
        _info()
        return _demo()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        raise
    except (ValueError, TypeError, OSError, MissingExtra) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def run() -> int:
    """``python -m attnx``: main() on sys.argv, quiet when stdout is closed early."""
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        # the reader went away (python -m attnx | head): stop quietly; point
        # stdout at devnull so the interpreter's final flush does not complain
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    return code
