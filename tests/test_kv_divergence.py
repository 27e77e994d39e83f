"""``attnx.integrations.transformers.cache_divergence`` and ``python -m attnx
kv-divergence``: each cache dtype's KL divergence and top-1 agreement against
transformers' default cache, under teacher forcing.

A random-weight Llama (GQA) and a word-level tokenizer, both built here and
saved to a temporary directory (nothing downloaded): a float32 cache's
distributions are the default cache's (KL below 1e-9, every top-1 agreeing);
int8 and bfloat16 diverge a little, int8's by a bounded amount; the command
prints one row per dtype and refuses a text too short, a missing model and an
unknown dtype in one line each.
"""

import copy
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import attnx.integrations.transformers as hf  # noqa: E402
import test_transformers  # noqa: E402

WORDS = ("the a cat dog sat on mat ran to house and then it was over under big small red "
         "blue old new one two three four five").split()


def model():
    cls, config = test_transformers.configs()["llama_gqa"][:2]
    config = copy.deepcopy(config)
    config.vocab_size = len(WORDS) + 2
    torch.manual_seed(0)
    m = cls(config).eval()
    m.set_attn_implementation("attnx")
    return m


def text(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return " ".join(WORDS[int(i)] for i in torch.randint(len(WORDS), (n,), generator=g))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The model and a word-level tokenizer, saved as from_pretrained reads them."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    d = tmp_path_factory.mktemp("model")
    vocab = {w: i for i, w in enumerate(["<unk>", "<pad>"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                                pad_token="<pad>")
    fast.save_pretrained(d)
    model().save_pretrained(d)
    (d / "text.txt").write_text(text(60))
    return d


def test_float32_cache_is_the_default_and_int8_diverges_a_little():
    hf.register()
    ids = torch.randint(2, len(WORDS) + 2, (1, 40), generator=torch.Generator().manual_seed(1))
    res = hf.cache_divergence(model(), ids, prefill=24, steps=16,
                              dtypes=["float32", "int8", "bfloat16"])
    assert list(res) == ["float32", "int8", "bfloat16"]
    assert res["float32"]["kl"] < 1e-9 and res["float32"]["top1"] == 1.0
    for d in ("int8", "bfloat16"):
        assert 0 < res[d]["kl"] <= res[d]["kl_max"] < 1e-2, (d, res[d])
        assert 0.8 <= res[d]["top1"] <= 1.0


def test_refusals_name_the_argument():
    hf.register()
    m, ids = model(), torch.randint(2, 20, (1, 10))
    with pytest.raises(ValueError, match="the text has 10 tokens; prefill=8 \\+ steps=4 need 12"):
        hf.cache_divergence(m, ids, prefill=8, steps=4)
    with pytest.raises(ValueError, match="dtypes: .*got 'int4'"):
        hf.cache_divergence(m, ids, prefill=4, steps=4, dtypes=["int4"])
    with pytest.raises(ValueError, match="input_ids must be"):
        hf.cache_divergence(m, ids[None], prefill=4, steps=4)


def run(*args):
    env = dict(os.environ, TRANSFORMERS_OFFLINE="1", HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "attnx", "kv-divergence", *args],
                          capture_output=True, text=True, env=env, timeout=600)


def test_command_prints_a_row_per_dtype(model_dir):
    res = run("--model", str(model_dir), "--text", str(model_dir / "text.txt"),
              "--prefill", "32", "--steps", "20", "--dtypes", "int8,float32")
    assert res.returncode == 0, res.stderr
    rows = {line.split()[0]: line.split()[1:] for line in res.stdout.splitlines()
            if line.split() and line.split()[0] in ("int8", "float32")}
    assert set(rows) == {"int8", "float32"}
    assert float(rows["float32"][0]) < 1e-9 and rows["float32"][2] == "100.0%"
    assert 0 < float(rows["int8"][0]) < 1e-2
    assert "32-token prompt, 20 decoding steps" in res.stdout


@pytest.mark.parametrize("args, words", [
    (["--prefill", "50", "--steps", "20"], "the text has 60 tokens"),
    (["--dtypes", "int4"], "got 'int4'"),
])
def test_command_mistakes_are_one_line(model_dir, args, words):
    res = run("--model", str(model_dir), "--text", str(model_dir / "text.txt"), *args)
    assert res.returncode == 2 and words in res.stderr
    assert [line for line in res.stderr.splitlines() if line.startswith("error:")] == \
        [res.stderr.strip().splitlines()[-1]]


def test_command_refuses_a_missing_model(tmp_path):
    (tmp_path / "t.txt").write_text("the cat")
    res = run("--model", str(tmp_path / "nowhere"), "--text", str(tmp_path / "t.txt"))
    assert res.returncode == 2 and "no such directory" in res.stderr
    res = run("--gguf", str(tmp_path / "m.gguf"), "--text", str(tmp_path / "t.txt"))
    assert res.returncode == 2 and "--gguf: no such file" in res.stderr
