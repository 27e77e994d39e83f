"""Regenerate docs/attention.png, the heatmap in the README (the tour notebook's weights).

    python examples/make_readme_figure.py [output.png]

Same inputs as examples/tour.ipynb, section 2: the seeds' sentence, 16-dimensional
random embeddings with "it" close to "animal", a projection to 8 features shared by
queries and keys. Needs matplotlib (pip install "attnx[plot]").
"""

from __future__ import annotations

import pathlib
import sys

import matplotlib

matplotlib.use("Agg")  # a file, never a window

import numpy as np  # noqa: E402

import attnx  # noqa: E402

OUT = pathlib.Path(__file__).resolve().parent.parent / "docs" / "attention.png"


def tour_weights():
    """Tokens and the (11, 11) attention weights of the tour notebook's single head."""
    sentence = "The animal didn't cross the street because it was too tired"
    tokens = sentence.split()
    d_model, d_k = 16, 8
    rng = np.random.default_rng(0)
    x = rng.standard_normal((len(tokens), d_model)).astype(np.float32)
    x[tokens.index("it")] = x[tokens.index("animal")] + 0.3 * x[tokens.index("it")]
    W_q = rng.standard_normal((d_model, d_k)).astype(np.float32) / np.sqrt(d_model)
    W_k = W_q
    W_v = rng.standard_normal((d_model, d_k)).astype(np.float32) / np.sqrt(d_model)
    Q, K, V = x @ W_q, x @ W_k, x @ W_v
    _, weights = attnx.scaled_dot_product_attention(Q, K, V, need_weights=True)
    return tokens, weights


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    out = pathlib.Path(argv[0]) if argv else OUT
    tokens, weights = tour_weights()
    fig = attnx.plot_attention(weights, tokens,
                               title='self-attention over the seeds\' sentence: "it" looks at "animal"')
    out.parent.mkdir(parents=True, exist_ok=True)
    # fixed metadata, so that regenerating an unchanged figure gives the same bytes
    fig.savefig(out, dpi=100, metadata={"Software": None})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
