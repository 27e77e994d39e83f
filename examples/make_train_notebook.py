"""Generate examples/train.ipynb, a small Transformer trained in NumPy on attnx's attention.

    python examples/make_train_notebook.py [output.ipynb]

The notebook is written from the cells below (markdown and code as plain strings),
without outputs, so that a review reads this file and the .ipynb stays in step.
"""

from __future__ import annotations

import pathlib
import sys


OUT = pathlib.Path(__file__).resolve().parent / "train.ipynb"


# --------------------------------------------------------------------------------------
# The notebook
# --------------------------------------------------------------------------------------

INTRO = r"""
# Training a small Transformer in NumPy, with attnx's attention

The tour showed attention at inference. This notebook **trains** a model: a small
Transformer encoder, written in NumPy with every gradient by hand, except that its
multi-head attention layers are `attnx.MultiHeadAttention`, whose `vjp` gives the
layer's output and a function returning the gradients of its inputs and weights
(the attention's backward is attnx's fused kernel).

The task is to **sort digits**: `3 1 4 1 5` → `1 1 3 4 5`. Output position *i* holds
the *i*-th smallest digit, which depends on every digit of the input: each position
has to look at the whole sequence, which is what attention does. Sequences have 2 to 16
digits, so a batch is **padded**, and the padding must be invisible: the lengths go to
the attention layers as `key_lengths` (and `query_lengths`), the encoder mask of the
pages attnx was built from (seed 002), without building it.

At the end the first 20 training steps are replayed in PyTorch from the same initial
weights, as a check of the gradients (skipped if torch is not installed).

Needs `pip install "attnx[plot]"`; training takes about half a minute on two cores.
"""

IMPORTS = r"""
import os
# One BLAS thread for NumPy (set before NumPy is imported; no effect if it already was):
# the matrices here are small, at most (1024, 256), and for them several BLAS threads
# cost more in start-up and synchronisation than they save (much more on a busy machine).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import time
import numpy as np
import pathlib
import matplotlib.pyplot as plt
import attnx

try:
    import torch
except ImportError:
    torch = None
print(f"attnx {attnx.__version__} ({attnx.isa()}, {attnx.get_num_threads()} threads), numpy {np.__version__}, "
      + (f"torch {torch.__version__}" if torch else "torch not installed (the last section is skipped)"))
"""

TASK_MD = r"""
## 1. The task and its padded batches

Tokens are the digits 0–9 and a padding token `PAD = 10`. A batch of `B` sequences with
lengths drawn from 2 to 16 is padded to its longest sequence. The target of a sequence
is the sorted sequence; as `PAD` is larger than every digit, sorting the padded row
puts the digits first and the padding last. The loss and the accuracy count only the
real positions (`real`, the padding mask of the tour: True = real token).
"""

TASK = r"""
PAD = 10                      # the padding token; the digits are 0..9
N_TOKENS = 11                 # digits + PAD (rows of the embedding table)
N_CLASSES = 10                # the model predicts a digit at each position
MIN_LEN, MAX_LEN = 2, 16

def make_batch(rng, B):
    # tokens (B, L) int, targets (B, L) int, lengths (B,), real (B, L) bool; L = longest length
    lengths = rng.integers(MIN_LEN, MAX_LEN + 1, size=B)              # (B,)
    L = lengths.max()
    real = attnx.padding_mask(lengths, L)                             # (B, L) True = real token
    tokens = np.where(real, rng.integers(0, 10, size=(B, L)), PAD)    # (B, L)
    targets = np.sort(tokens, axis=1)                                 # (B, L), PAD sorts last
    targets = np.where(real, targets, 0)                              # padded targets: ignored
    return tokens, targets, lengths, real

tokens, targets, lengths, real = make_batch(np.random.default_rng(0), 3)
print("lengths", lengths, "padded to", tokens.shape[1])
for t, y, n in zip(tokens, targets, lengths):
    print(" ".join(f"{d:2d}" for d in t), "  ->  ", " ".join(str(d) for d in y[:n]))
"""

MODEL_MD = r"""
## 2. The model

A Transformer encoder (pre-layer-norm, as in most current models), two layers of
width `d_model = 64`:

```
tokens (B, L) ─ embedding + positional encoding ─> h (B, L, 64)
   2 × [ h = h + MultiHeadAttention(LayerNorm(h), key_lengths, query_lengths)   # attnx
         h = h + FeedForward(LayerNorm(h)) ]                                    # 64 -> 256 -> 64, ReLU
   LayerNorm ─ Linear(64, 10) ─> logits (B, L, 10)
```

### Positional encoding

Attention itself ignores order, so each position's embedding gets the sinusoidal
encoding of *Attention Is All You Need*:
$PE_{p, 2i} = \sin(p / 10000^{2i/d})$, $PE_{p, 2i+1} = \cos(p / 10000^{2i/d})$.
"""

PE = r"""
d_model, num_heads, d_ff, n_layers = 64, 4, 256, 2

def positional_encoding(L, d):
    # (L, d) float32: sin on even features, cos on odd ones
    pos = np.arange(L)[:, None]                                  # (L, 1)
    angle = pos / 10000 ** (np.arange(0, d, 2)[None, :] / d)     # (L, d/2)
    pe = np.zeros((L, d), dtype=np.float32)
    pe[:, 0::2], pe[:, 1::2] = np.sin(angle), np.cos(angle)
    return pe

PE = positional_encoding(MAX_LEN, d_model)                       # (16, 64)
fig, ax = plt.subplots(figsize=(7, 2.2), layout="constrained")
ax.imshow(PE.T, aspect="auto", cmap="RdBu", interpolation="nearest", vmin=-1, vmax=1)
ax.set(xlabel="position", ylabel="feature", title="sinusoidal positional encoding");
"""

PARAMS_MD = r"""
### The weights

All weights are float32 NumPy arrays in one dict, `params`, which the optimiser walks.
The attention layers are `attnx.MultiHeadAttention` objects (4 heads of 16 features);
`layer.parameters()` returns their **live** arrays (`W_q`, `W_k`, `W_v`, `W_o`, `b_q`,
`b_k`, `b_v`, `b_o`), so `params` holds the layer's own arrays and updating them in
place updates the layer. The other weights are initialised as PyTorch does
(embeddings N(0, 1), linear layers U(±1/√fan_in), layer norms 1 and 0), and a copy of
the whole initial state is kept for the PyTorch check at the end.
"""

PARAMS = r"""
rng = np.random.default_rng(42)

def linear_init(fan_in, fan_out):
    a = 1 / np.sqrt(fan_in)
    return (rng.uniform(-a, a, (fan_in, fan_out)).astype(np.float32),    # W (fan_in, fan_out)
            rng.uniform(-a, a, fan_out).astype(np.float32))              # b (fan_out,)

params = {"embed": rng.standard_normal((N_TOKENS, d_model)).astype(np.float32)}   # (11, 64)
attention = []
for l in range(n_layers):
    mha = attnx.MultiHeadAttention(d_model, num_heads, seed=100 + l)      # d_head = 16
    attention.append(mha)
    params.update({f"{l}.attn.{name}": w for name, w in mha.parameters().items()})   # live arrays
    params[f"{l}.ln1.g"], params[f"{l}.ln1.b"] = np.ones(d_model, np.float32), np.zeros(d_model, np.float32)
    params[f"{l}.ln2.g"], params[f"{l}.ln2.b"] = np.ones(d_model, np.float32), np.zeros(d_model, np.float32)
    params[f"{l}.ff.W1"], params[f"{l}.ff.b1"] = linear_init(d_model, d_ff)    # (64, 256), (256,)
    params[f"{l}.ff.W2"], params[f"{l}.ff.b2"] = linear_init(d_ff, d_model)    # (256, 64), (64,)
params["lnf.g"], params["lnf.b"] = np.ones(d_model, np.float32), np.zeros(d_model, np.float32)
params["out.W"], params["out.b"] = linear_init(d_model, N_CLASSES)             # (64, 10), (10,)

assert params["0.attn.W_q"] is attention[0].W_q               # the same array, not a copy
initial = {name: w.copy() for name, w in params.items()}      # for the PyTorch check
print(attention[0])
print(len(params), "arrays,", sum(w.size for w in params.values()), "weights, all",
      {str(w.dtype) for w in params.values()})
"""

BLOCKS_MD = r"""
### The pieces and their gradients

Each piece is a function returning its output and a **vjp** closure, the convention of
`MultiHeadAttention.vjp`: given the gradient of the loss with respect to the output, the
closure returns the gradient with respect to the input and a dict of weight gradients.

* **Layer norm** over the features: $\hat x = (x - \mu)/\sqrt{\sigma^2 + \epsilon}$,
  $y = g \hat x + b$. Backward:
  $dx = \big(d\hat x - \overline{d\hat x} - \hat x\, \overline{d\hat x\, \hat x}\big)/\sqrt{\sigma^2+\epsilon}$
  with $d\hat x = g\, dy$ and bars for means over the features.
* **Feed-forward**: $y = \mathrm{ReLU}(x W_1 + b_1) W_2 + b_2$.
* **Linear**: $y = x W + b$, so $dx = dy\, W^\top$, $dW = x^\top dy$, $db = \sum dy$.
* **Cross-entropy** over the real positions, averaged: with $p = \mathrm{softmax}(z)$,
  $\partial \mathrm{loss}/\partial z = (p - \mathrm{onehot}(y)) / N_\text{real}$ at real
  positions and 0 at padded ones.
"""

BLOCKS = r"""
EPS = 1e-5

def flat(a):
    # (B, L, n) -> (B*L, n)
    return a.reshape(-1, a.shape[-1])

def linear_vjp(x, W, b):
    # x (B, L, n_in) -> y (B, L, n_out)
    y = x @ W + b
    def vjp(dy):
        return dy @ W.T, {"W": flat(x).T @ flat(dy), "b": flat(dy).sum(axis=0)}
    return y, vjp

def layer_norm_vjp(x, g, b):
    # x (B, L, d) -> y (B, L, d), normalised over the d features
    mu = x.mean(axis=-1, keepdims=True)
    inv_std = 1 / np.sqrt(x.var(axis=-1, keepdims=True) + EPS)     # (B, L, 1)
    x_hat = (x - mu) * inv_std
    def vjp(dy):
        dx_hat = dy * g
        dx = inv_std * (dx_hat - dx_hat.mean(axis=-1, keepdims=True)
                        - x_hat * (dx_hat * x_hat).mean(axis=-1, keepdims=True))
        return dx, {"g": flat(dy * x_hat).sum(axis=0), "b": flat(dy).sum(axis=0)}
    return x_hat * g + b, vjp

def feed_forward_vjp(x, W1, b1, W2, b2):
    # x (B, L, d) -> (B, L, d_ff) -> ReLU -> y (B, L, d)
    u, vjp1 = linear_vjp(x, W1, b1)
    r = np.maximum(u, 0)
    y, vjp2 = linear_vjp(r, W2, b2)
    def vjp(dy):
        dr, g2 = vjp2(dy)
        dx, g1 = vjp1(dr * (u > 0))
        return dx, {"W1": g1["W"], "b1": g1["b"], "W2": g2["W"], "b2": g2["b"]}
    return y, vjp

def cross_entropy(logits, targets, real):
    # logits (B, L, C), targets (B, L) int, real (B, L) bool -> mean loss over real positions, dlogits
    z = logits - logits.max(axis=-1, keepdims=True)
    log_p = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))              # (B, L, C)
    nll = -np.take_along_axis(log_p, targets[..., None], axis=-1)[..., 0]  # (B, L)
    n_real = float(real.sum())
    loss = float(nll[real].sum()) / n_real
    dlogits = np.exp(log_p)
    dlogits[..., :] -= np.eye(logits.shape[-1], dtype=np.float32)[targets]  # p - onehot(y)
    dlogits *= real[..., None] / np.float32(n_real)                         # 0 at padded positions
    return loss, dlogits
"""

MODEL_VJP_MD = r"""
### The whole model

`transformer_vjp` runs the forward pass, keeping each piece's vjp, and returns the
logits and a function that runs them backwards. The attention layers are called with
`layer.vjp(a, key_lengths=lengths, query_lengths=lengths)`: keys past a sequence's
length are ignored (the padding mask), and padded query rows attend to nothing. The
residual connections add gradients: `dh` flows around each block and into it. The
embedding's gradient adds each position's gradient into the row of its token
(`np.add.at`).
"""

MODEL_VJP = r"""
def transformer_vjp(tokens, lengths, use_lengths=True):
    # tokens (B, L) int, lengths (B,) -> logits (B, L, 10), backward(dlogits) -> {name: gradient}
    P = params
    B, L = tokens.shape
    pad = dict(key_lengths=lengths, query_lengths=lengths) if use_lengths else {}
    h = P["embed"][tokens] + PE[:L]                                        # (B, L, d_model)
    tape = []
    for l, mha in enumerate(attention):
        a, ln1 = layer_norm_vjp(h, P[f"{l}.ln1.g"], P[f"{l}.ln1.b"])
        z, attn = mha.vjp(a, **pad)                                        # (B, L, d_model), attnx
        h = h + z
        f, ln2 = layer_norm_vjp(h, P[f"{l}.ln2.g"], P[f"{l}.ln2.b"])
        y, ff = feed_forward_vjp(f, P[f"{l}.ff.W1"], P[f"{l}.ff.b1"], P[f"{l}.ff.W2"], P[f"{l}.ff.b2"])
        h = h + y
        tape.append((ln1, attn, ln2, ff))
    o, lnf = layer_norm_vjp(h, P["lnf.g"], P["lnf.b"])
    logits, head = linear_vjp(o, P["out.W"], P["out.b"])                   # (B, L, 10)

    def backward(dlogits):
        grads = {}
        def keep(prefix, g):
            grads.update({prefix + name: d for name, d in g.items()})
        do, g = head(dlogits);  keep("out.", g)
        dh, g = lnf(do);        keep("lnf.", g)                            # dh: d loss / d h, (B, L, d_model)
        for l in reversed(range(len(attention))):
            ln1, attn, ln2, ff = tape[l]
            df, g = ff(dh);     keep(f"{l}.ff.", g)
            dx, g = ln2(df);    keep(f"{l}.ln2.", g)
            dh = dh + dx                                                   # residual: both paths
            g = attn(dh)                                                   # attnx: query + weights
            da = g.pop("query");  keep(f"{l}.attn.", g)
            dx, g = ln1(da);    keep(f"{l}.ln1.", g)
            dh = dh + dx
        grads["embed"] = np.zeros_like(P["embed"])
        np.add.at(grads["embed"], tokens, dh)                              # (11, d_model)
        return grads

    return logits, backward

tokens, targets, lengths, real = make_batch(np.random.default_rng(1), 4)
logits, backward = transformer_vjp(tokens, lengths)
loss, dlogits = cross_entropy(logits, targets, real)
grads = backward(dlogits)
assert grads.keys() == params.keys()
assert all(grads[n].shape == w.shape and grads[n].dtype == np.float32 for n, w in params.items())
print(f"logits {logits.shape} {logits.dtype}, loss {loss:.3f} (untrained: about ln 10 = {np.log(10):.3f})")
"""

ADAM_MD = r"""
## 3. Adam

Adam keeps running averages of each gradient and of its square, and steps by their
ratio (with the bias correction of the first steps), exactly as `torch.optim.Adam`.
The arrays are updated in place (`w -= ...`), which is what makes `params` and the
attention layers' own weights the same arrays.
"""

ADAM = r"""
class Adam:
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8):
        self.params, self.lr, self.betas, self.eps, self.t = params, lr, betas, eps, 0
        self.m = {n: np.zeros_like(w) for n, w in params.items()}    # mean of the gradient
        self.v = {n: np.zeros_like(w) for n, w in params.items()}    # mean of its square

    def step(self, grads):
        self.t += 1
        b1, b2 = self.betas
        for n, w in self.params.items():
            self.m[n] = b1 * self.m[n] + (1 - b1) * grads[n]
            self.v[n] = b2 * self.v[n] + (1 - b2) * grads[n] ** 2
            m_hat = self.m[n] / (1 - b1 ** self.t)
            v_hat = self.v[n] / (1 - b2 ** self.t)
            w -= self.lr * m_hat / (np.sqrt(v_hat) + self.eps)        # in place
"""

TRAIN_MD = r"""
## 4. Training

800 steps of 64 sequences, each a fresh random batch from a seeded generator (the
PyTorch check replays the first 20). The learning rate rises linearly to 2·10⁻³ over
the first 100 steps (a *warm-up*, as in the Transformer paper: Adam's first steps are
large) and then decreases linearly to 0, which lets the last steps settle instead of
bouncing.
"""

TRAIN = r"""
STEPS, BATCH, LR, WARMUP, DATA_SEED = 800, 64, 2e-3, 100, 1234

def learning_rate(step):
    # linear warm-up for WARMUP steps, then linear decay to 0 at STEPS
    return LR * min((step + 1) / WARMUP, (STEPS - step) / (STEPS - WARMUP))

data = np.random.default_rng(DATA_SEED)
opt = Adam(params, lr=LR)
losses, accuracies = [], []

t0 = time.perf_counter()
for step in range(STEPS):
    tokens, targets, lengths, real = make_batch(data, BATCH)     # (64, L), L <= 16
    logits, backward = transformer_vjp(tokens, lengths)          # (64, L, 10)
    loss, dlogits = cross_entropy(logits, targets, real)
    opt.lr = learning_rate(step)
    opt.step(backward(dlogits))
    losses.append(loss)
    accuracies.append(float((logits.argmax(-1) == targets)[real].mean()))
    if step % 100 == 0 or step == STEPS - 1:
        print(f"step {step:4d}  loss {loss:.4f}  batch token accuracy {accuracies[-1]:.3f}"
              f"  ({time.perf_counter() - t0:.0f} s)")
train_seconds = time.perf_counter() - t0
print(f"{STEPS} steps in {train_seconds:.0f} s ({1000 * train_seconds / STEPS:.1f} ms per step)")
"""

PLOT_MD = r"""
The loss per step, and the token accuracy of each training batch. The figure is also
saved as `docs/train_loss.png` (shown in the README) when the notebook runs in the
repository (from `examples/` or from its root); elsewhere, next to the notebook.
"""

PLOT = r"""
def smooth(a, k=25):
    return np.convolve(a, np.ones(k) / k, mode="valid")

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.4), layout="constrained")
ax1.plot(losses, lw=0.6, alpha=0.4, color="C0")
ax1.plot(np.arange(len(smooth(losses))) + 12, smooth(losses), color="C0")
ax1.set(yscale="log", xlabel="step", ylabel="cross-entropy", title="training loss")
ax2.plot(accuracies, lw=0.6, alpha=0.4, color="C1")
ax2.plot(np.arange(len(smooth(accuracies))) + 12, smooth(accuracies), color="C1")
ax2.set(xlabel="step", ylabel="token accuracy", ylim=(0, 1.02), title="accuracy (training batches)")
fig.suptitle("sorting 2–16 digits: a 2-layer Transformer in NumPy, attention by attnx.MultiHeadAttention")

docs = next((p for p in (pathlib.Path("../docs"), pathlib.Path("docs")) if (p / "attention.png").exists()),
            pathlib.Path("."))
fig.savefig(docs / "train_loss.png", dpi=100, metadata={"Software": None})
print("saved", docs / "train_loss.png")
"""

EVAL_MD = r"""
## 5. Accuracy on new sequences

2000 sequences the model has not seen (another seed), in batches padded as in
training. Token accuracy counts the real positions; a sequence is right when all its
positions are.
"""

EVAL = r"""
def evaluate(n=2000, seed=7, use_lengths=True):
    rng_test = np.random.default_rng(seed)
    right = total = seq_right = 0
    for _ in range(n // 100):
        tokens, targets, lengths, real = make_batch(rng_test, 100)
        logits, _ = transformer_vjp(tokens, lengths, use_lengths)
        ok = (logits.argmax(-1) == targets) | ~real                # (100, L), padding counts as right
        right += int(ok[real].sum()); total += int(real.sum()); seq_right += int(ok.all(axis=1).sum())
    return right / total, seq_right / n

token_acc, seq_acc = evaluate()
print(f"token accuracy {token_acc:.4f}, whole sequences sorted right {seq_acc:.4f}")
assert token_acc >= 0.95

tokens, targets, lengths, real = make_batch(np.random.default_rng(8), 5)
pred = transformer_vjp(tokens, lengths)[0].argmax(-1)
for t, p, n in zip(tokens, pred, lengths):
    print(f"{' '.join(map(str, t[:n])):>32}  ->  {' '.join(map(str, p[:n]))}")
"""

PADDING_MD = r"""
### The padding is invisible

With `key_lengths` and `query_lengths` a sequence's result does not depend on how much
padding its batch added: the same sequence alone and padded to 16 tokens gives the
same logits (to float32 rounding). Without the lengths, the model attends to the `PAD`
tokens it never saw in training, and its accuracy drops.
"""

PADDING = r"""
seq = np.array([[7, 2, 9, 2, 0]])                                            # (1, 5)
alone = transformer_vjp(seq, np.array([5]))[0]                               # (1, 5, 10)
padded = np.concatenate([seq, np.full((1, 11), PAD)], axis=1)               # (1, 16)
in_batch = transformer_vjp(padded, np.array([5]))[0][:, :5]                  # (1, 5, 10)
print("sorted:", alone.argmax(-1)[0], " max |logits alone - logits padded| =", np.abs(alone - in_batch).max())

token_acc_no_lengths, _ = evaluate(use_lengths=False)
print(f"token accuracy without key_lengths/query_lengths: {token_acc_no_lengths:.3f} (with: {token_acc:.3f})")
"""

MAPS_MD = r"""
### What the attention layers look at

The weights for one sequence, from the layers called with `need_weights=True` (the
forward pass again, without the vjps). In the first layer the heads spread over the
whole sequence: each position can take in how many of each digit there are. The
figure shows the second layer's heads: rows are the output positions (labelled
*position → predicted digit*), columns the input digits; some heads pick out the
digits that belong at a position, for instance the largest ones from the last positions.
"""

MAPS = r"""
def attention_maps(seq):
    # seq (L,) digits -> the (H, L, L) weights of each layer
    tokens, lengths = np.array([seq]), np.array([len(seq)])
    h = params["embed"][tokens] + PE[:len(seq)]
    maps = []
    for l, mha in enumerate(attention):
        a = layer_norm_vjp(h, params[f"{l}.ln1.g"], params[f"{l}.ln1.b"])[0]
        z, w = mha(a, key_lengths=lengths, query_lengths=lengths, need_weights=True)  # w (1, H, L, L)
        maps.append(w[0])
        h = h + z
        f = layer_norm_vjp(h, params[f"{l}.ln2.g"], params[f"{l}.ln2.b"])[0]
        h = h + feed_forward_vjp(f, *(params[f"{l}.ff.{n}"] for n in ("W1", "b1", "W2", "b2")))[0]
    return maps

seq = [7, 2, 9, 2, 0, 5, 3, 8, 2, 6]
pred = transformer_vjp(np.array([seq]), np.array([len(seq)]))[0].argmax(-1)[0]
maps = attention_maps(seq)
print(f"layer 0: largest weight {maps[0].max():.2f} (uniform over {len(seq)} digits: {1 / len(seq):.2f})")
fig = attnx.plot_attention(maps[1], [f"{i} → {d}" for i, d in enumerate(pred)], [str(d) for d in seq],
                           title="layer 1: output positions (rows) attending to the input digits")
"""

TORCH_MD = r"""
## 6. Check: the same training in PyTorch

The same model written with `torch.nn` modules (`nn.Embedding`, `nn.LayerNorm`,
`nn.MultiheadAttention` with `key_padding_mask`, `nn.Linear`), starting from the same
initial weights (`initial`, copied before training), trained on the same first 20
batches with `torch.optim.Adam`, the same hyperparameters and learning rates. Autograd computes its
gradients; if ours (and attnx's) were wrong, the losses would part within a few steps.

Two conventions differ: torch's `Linear` stores `W` transposed ((out, in), for
`x @ W.T + b`), and `nn.MultiheadAttention` packs the three input projections into one
`in_proj_weight` (3·64, 64). Padded query rows are not zeroed by torch (it has no
`query_lengths`), but they are not in the loss, so the losses are the same.
"""

TORCH = r"""
if torch is None:
    print("torch is not installed: skipping the PyTorch check")
else:
    torch.manual_seed(0)
    nn = torch.nn
    T = lambda a: torch.from_numpy(np.array(a, dtype=np.float32))    # a float32 tensor (copy)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d_model, eps=EPS), nn.LayerNorm(d_model, eps=EPS)
            self.attn = nn.MultiheadAttention(d_model, num_heads, batch_first=True)
            self.ff1, self.ff2 = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)

        def forward(self, h, key_padding_mask):
            a = self.ln1(h)
            h = h + self.attn(a, a, a, key_padding_mask=key_padding_mask, need_weights=False)[0]
            return h + self.ff2(torch.relu(self.ff1(self.ln2(h))))

    class TorchSorter(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(N_TOKENS, d_model)
            self.blocks = nn.ModuleList(Block() for _ in range(n_layers))
            self.lnf, self.out = nn.LayerNorm(d_model, eps=EPS), nn.Linear(d_model, N_CLASSES)

        def forward(self, tokens, lengths):
            L = tokens.shape[1]
            key_padding_mask = torch.arange(L)[None, :] >= lengths[:, None]   # (B, L) True = pad
            h = self.embed(tokens) + T(PE[:L])
            for block in self.blocks:
                h = block(h, key_padding_mask)
            return self.out(self.lnf(h))

    def load(model, w):
        # copy the NumPy initial weights into the torch model
        with torch.no_grad():
            model.embed.weight.copy_(T(w["embed"]))
            for l, blk in enumerate(model.blocks):
                p = f"{l}.attn."
                blk.attn.in_proj_weight.copy_(T(np.concatenate([w[p + "W_q"].T, w[p + "W_k"].T, w[p + "W_v"].T])))
                blk.attn.in_proj_bias.copy_(T(np.concatenate([w[p + "b_q"], w[p + "b_k"], w[p + "b_v"]])))
                blk.attn.out_proj.weight.copy_(T(w[p + "W_o"].T)); blk.attn.out_proj.bias.copy_(T(w[p + "b_o"]))
                for name, ln in (("ln1", blk.ln1), ("ln2", blk.ln2)):
                    ln.weight.copy_(T(w[f"{l}.{name}.g"])); ln.bias.copy_(T(w[f"{l}.{name}.b"]))
                blk.ff1.weight.copy_(T(w[f"{l}.ff.W1"].T)); blk.ff1.bias.copy_(T(w[f"{l}.ff.b1"]))
                blk.ff2.weight.copy_(T(w[f"{l}.ff.W2"].T)); blk.ff2.bias.copy_(T(w[f"{l}.ff.b2"]))
            model.lnf.weight.copy_(T(w["lnf.g"])); model.lnf.bias.copy_(T(w["lnf.b"]))
            model.out.weight.copy_(T(w["out.W"].T)); model.out.bias.copy_(T(w["out.b"]))
        return model

    model = load(TorchSorter(), initial)
    torch_opt = torch.optim.Adam(model.parameters(), lr=LR, betas=opt.betas, eps=opt.eps)
    data = np.random.default_rng(DATA_SEED)                          # the same batches again
    torch_losses = []
    for step in range(20):
        for group in torch_opt.param_groups:
            group["lr"] = learning_rate(step)                        # the same schedule
        tokens, targets, lengths, real = make_batch(data, BATCH)
        logits = model(torch.from_numpy(tokens), torch.from_numpy(lengths))      # (64, L, 10)
        mask = torch.from_numpy(real)
        loss = torch.nn.functional.cross_entropy(logits[mask], torch.from_numpy(targets)[mask])
        torch_opt.zero_grad()
        loss.backward()
        torch_opt.step()
        torch_losses.append(loss.item())

    diff = np.abs(np.array(losses[:20]) - np.array(torch_losses))
    for step in (0, 1, 2, 9, 19):
        print(f"step {step:2d}  numpy {losses[step]:.6f}  torch {torch_losses[step]:.6f}")
    print(f"max |loss_numpy - loss_torch| over the first 20 steps: {diff.max():.2e}")
    assert diff.max() < 1e-4
"""


def cells():
    import nbformat.v4 as v4

    def md(s):
        return v4.new_markdown_cell(s.strip("\n"))

    def code(s, **metadata):
        return v4.new_code_cell(s.strip("\n"), metadata=metadata)

    return [
        md(INTRO), code(IMPORTS),
        md(TASK_MD), code(TASK),
        md(MODEL_MD), code(PE),
        md(PARAMS_MD), code(PARAMS),
        md(BLOCKS_MD), code(BLOCKS),
        md(MODEL_VJP_MD), code(MODEL_VJP),
        md(ADAM_MD), code(ADAM),
        md(TRAIN_MD), code(TRAIN),
        md(PLOT_MD), code(PLOT),
        md(EVAL_MD), code(EVAL),
        md(PADDING_MD), code(PADDING),
        md(MAPS_MD), code(MAPS),
        md(TORCH_MD), code(TORCH),
    ]


def main(argv=None):
    import _notebook          # examples/_notebook.py, beside this script

    return _notebook.write(cells(), OUT, argv)


if __name__ == "__main__":
    sys.exit(main())
