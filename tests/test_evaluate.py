"""Evaluation on the 8-device test mesh: HellaSwag accuracy and eval loss against an independent
computation (a plain forward per candidate, full-vocabulary log-softmax in numpy)."""
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax import config as C
from k3jax.data import sft, tiny_tokenizer
from k3jax.data.tokenizer import KimiTokenizer
from k3jax.evaluate import Evaluator
from k3jax.sharding import make_mesh
from k3jax.state import init_state

SAMPLE = Path(__file__).parent / "assets" / "hellaswag_sample.jsonl"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    tiny_tokenizer.build(d, vocab_size=1024, num_reserved=tiny_tokenizer.MIN_RESERVED)
    cfg = C.load(C.REPO_CONFIGS / "base.yml", [
        "model_name=tiny", "vocab_size=1024", f"tokenizer_path={d}", "dataset_type=sft", "sft_format=hellaswag",
        f"dataset_path={SAMPLE}", f"eval_dataset_path={SAMPLE}", "eval_steps=-1", "eval_per_device_batch_size=2",
        "max_target_length=384"])
    mesh = make_mesh(cfg)
    gdef, state, _ = init_state(cfg, mesh)
    tok = KimiTokenizer.from_dir(d)
    return cfg, mesh, gdef, state, tok


def reference(cfg, gdef, state, tok):
    """Per row: the four endings' summed answer losses from a plain forward of each candidate."""
    import json
    model = nnx.merge(gdef, jax.device_get(state["params"]), jax.device_get(state["rest"]))
    forward = nnx.jit(lambda m, t: m(t)[0])
    scores, weights, labels = [], [], []
    for line in SAMPLE.read_text().splitlines():
        cands, label = sft.hellaswag_candidates(tok, json.loads(line))
        # Padded at the end to one length (one compile); causal, so positions < L are unaffected.
        padded = np.zeros((len(cands), cfg.train.max_target_length), np.int32)
        for i, (t, _) in enumerate(cands):
            padded[i, :len(t)] = t
        logits = np.asarray(forward(model, jnp.asarray(padded)), np.float64)                # [4, T, V]
        row_s, row_w = [], []
        for (t, w), zz in zip(cands, logits):
            z = zz[:len(t)]                                                                 # [L, V]
            logp = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(-1, keepdims=True)
            nll = -logp[np.arange(len(t) - 1), t[1:]]                                        # predicts token i+1
            row_s.append(float((nll * w[1:]).sum()))
            row_w.append(float(w[1:].sum()))
        scores.append(row_s)
        weights.append(row_w)
        labels.append(label)
    return np.asarray(scores), np.asarray(weights), np.asarray(labels)


def test_hellaswag_accuracy_and_loss_match_a_plain_forward(setup):
    cfg, mesh, gdef, state, tok = setup
    ev = Evaluator(cfg, mesh, gdef, tok)
    got = ev.run(state)
    scores, weights, labels = reference(cfg, gdef, state, tok)
    rows = np.arange(len(labels))
    assert got["eval_hellaswag_rows"] == len(labels) == 20
    assert got["eval_hellaswag_accuracy"] == pytest.approx(np.mean(scores.argmin(-1) == labels))
    want_loss = scores[rows, labels].sum() / weights[rows, labels].sum()
    assert got["eval_loss"] == pytest.approx(want_loss, rel=1e-4)
    assert got["eval_tokens"] == weights[rows, labels].sum()
    again = ev.run(state)          # the same batches every time, and no second compile
    assert again["eval_loss"] == got["eval_loss"] and again["eval_hellaswag_accuracy"] == got["eval_hellaswag_accuracy"]
