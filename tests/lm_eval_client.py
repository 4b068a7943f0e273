"""lm-evaluation-harness (`python -m lm_eval`, offline) as a real client of the server (run by
tests/test_serve.py on its served fixture): a local
multiple-choice task through `local-completions` (echo + logprobs, the remote tokenizer routes),
every choice's log-likelihood checked against a forward over the same token ids, and a
`generate_until` task through `local-chat-completions`."""
import json
import os
import subprocess
import sys
import time

import jax
import numpy as np
from flax import nnx

COLORS = ["red", "blue", "green", "black"]


def write_task(root, name, docs, body):
    """docs -> root/name.jsonl and a task YAML that reads it with datasets' json loader."""
    data = root / f"{name}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (root / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        f"test_split: test\n{body}")


def lm_eval(model, url, context, model_args, task, root, *extra):
    """Run lm-eval in a subprocess (offline) -> (stdout, the samples of task as parsed JSON)."""
    out = root / f"out-{model}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(root / "hf"),
           "OPENAI_API_KEY": "unused", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "lm_eval", "--model", model,
           "--model_args", f"base_url={url},max_length={context},max_retries=1,{model_args}",
           "--tasks", task, "--include_path", str(root), "--log_samples", "--output_path", str(out), *extra]
    start = time.time()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    print(f"$ lm_eval {' '.join(cmd[3:])}  ({time.time() - start:.1f} s)\n{r.stdout}")
    assert list(out.rglob("results_*.json")), "lm-eval wrote no results file"
    (samples,) = out.rglob(f"samples_{task}_*.jsonl")
    return r.stdout, [json.loads(line) for line in samples.read_text().splitlines()]


def encode_pair(tok, context, continuation):
    """lm-eval's split for causal models: trailing spaces of the context move to the continuation,
    the whole is encoded, the continuation is what follows the context's tokens."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole, ctx = tok.encode(context + continuation), tok.encode(context)
    assert whole[:len(ctx)] == ctx
    return ctx, whole[len(ctx):]


def check_lm_eval(served, tmp_path, context):
    """Both tasks against served (test_serve.py's fixture, max_target_length=context); prints
    lm-eval's tables."""
    rng = np.random.default_rng(0)
    docs = []
    for i in range(20):
        a, b = (int(x) for x in rng.integers(1, 20, 2))
        if i % 2:
            docs.append({"question": f"Question: what is {a} plus {b}?\nAnswer:",
                         "choices": [str(a + b), str(a + b + 1), str(abs(a - b)), str(a * b)], "answer": 0})
        else:
            docs.append({"question": f"Question: which colour is item {a}?\nAnswer:",
                         "choices": COLORS, "answer": int(rng.integers(0, 4))})
    write_task(tmp_path, "k3jax_mc", docs, "output_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
               "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n")
    table, samples = lm_eval("local-completions", served.url + "/v1/completions", context,
                             f"model={served.name},tokenizer_backend=remote", "k3jax_mc", tmp_path,
                             "--batch_size", "8")
    assert "k3jax_mc" in table and len(samples) == len(docs)
    # Every (context, choice) request: lm-eval's log-likelihood against a forward over the same ids
    # (right-padded to one shape: the model is causal, so the padding changes no earlier position).
    pairs, got = [], []
    for s in sorted(samples, key=lambda s: s["doc_id"]):
        for args, resp in zip(s["arguments"].values(), s["resps"], strict=True):
            pairs.append(encode_pair(served.tok, args["arg_0"], args["arg_1"]))
            got.append(float(resp[0][0]))   # written as strings
    assert len(pairs) == 4 * len(docs)
    width = max(len(c) + len(x) for c, x in pairs)
    ids = np.zeros((len(pairs), width), np.int32)
    for k, (c, x) in enumerate(pairs):
        ids[k, :len(c) + len(x)] = c + x
    with jax.set_mesh(served.mesh):
        lp = np.asarray(nnx.jit(lambda m, t: jax.nn.log_softmax(m(t)[0]))(served.model, jax.numpy.asarray(ids)))
    want = [sum(lp[k, len(c) + j - 1, t] for j, t in enumerate(x)) for k, (c, x) in enumerate(pairs)]
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    print(f"{len(got)} log-likelihoods, largest difference from the forward {np.max(np.abs(np.subtract(got, want))):.2e}")

    # generate_until through chat completions (the server applies the chat template).
    write_task(tmp_path, "k3jax_gen", [{"question": f"Name a colour like {c}.", "answer": c} for c in COLORS],
               "output_type: generate_until\ndoc_to_text: '{{question}}'\ndoc_to_target: '{{answer}}'\n"
               "generation_kwargs:\n  until: ['\\n\\n']\n  max_gen_toks: 8\n  do_sample: false\n"
               "metric_list:\n  - metric: exact_match\n")
    table, samples = lm_eval("local-chat-completions", served.url + "/v1/chat/completions", context,
                             f"model={served.name}", "k3jax_gen", tmp_path, "--apply_chat_template")
    assert "k3jax_gen" in table and len(samples) == len(COLORS)
    assert all(isinstance(s["resps"][0][0], str) and s["resps"][0][0] for s in samples), [s["resps"] for s in samples]
    assert served.engine.error is None
