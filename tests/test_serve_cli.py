"""``python -m k3jax.serve`` as a process: SIGTERM drains (no new connections, open requests finish,
exit 0), and a pod of two processes (scripts/local_pod.sh) serves what one process serves and
drains the same way. One test: the single process is both the pod's reference and the drained
server (one server start fewer). What is checked is process mechanics, so the model is the tiny
one cut to 4 layers (KDA, MLA, dense, MoE and AttnRes still present) with random weights: its three
server starts (one process, then the pod's two) compile the serving programs in 14 s each against
31 s for the 13-layer tiny (measured on this host)."""
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import openai
import pytest

from helpers import REPO, TINY_TRAIN, check_greedy, tool_env

SMALL = ["num_layers=4", "mla_every=4", "mla_extra_layers=[]", "attn_res_block_size=2"]
SERVE = ["max_target_length=96", "serve_prefill_chunk=16", "serve_max_batch=1", "serve_max_queue=4"]
# Few tokens: a pod of CPU processes pays gloo collectives (weight all-gathers) at every step.
PROMPTS = [("The cat", 6), ([5, 17, 200, 33, 41, 9, 77, 3, 18, 250, 61, 2, 90, 14, 8, 100, 7, 31], 8)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random-weight checkpoint of the 4-layer tiny model and a tokenizer -> its key=values."""
    import jax

    from k3jax import config as C
    from k3jax.checkpoint import save_weights
    from k3jax.data import tiny_tokenizer
    from k3jax.sharding import make_mesh
    from k3jax.state import init_state
    root = tmp_path_factory.mktemp("serve-cli")
    tok = tiny_tokenizer.build(root / "tokenizer", vocab_size=512, num_reserved=tiny_tokenizer.MIN_RESERVED)
    args = TINY_TRAIN + SMALL + [f"tokenizer_path={tok}", f"base_output_directory={root}"]
    cfg = C.load(C.REPO_CONFIGS / "base.yml", args)
    _, state, _ = init_state(cfg, make_mesh(cfg, jax.devices()[:1]))
    path = save_weights(root / "checkpoints", state["params"], state["rest"])
    return args + [f"load_parameters_path={path}"]


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_ready(proc, port, log, timeout=600):
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, f"server exited ({proc.returncode}):\n{open(log).read()[-4000:]}"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"server not listening after {timeout}s:\n{open(log).read()[-4000:]}")


def start(cmd, port, tmp_path):
    log = tmp_path / "server.log"
    proc = subprocess.Popen(cmd, env=tool_env(), cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    wait_ready(proc, port, log)
    return proc, log


def greedy(client, name):
    """-> per prompt (token ids, their logprobs, top-2 {"token_id:i": logprob} per position)."""
    out = []
    for prompt, n in PROMPTS:
        lp = client.completions.create(model=name, prompt=prompt, max_tokens=n, temperature=0, logprobs=2,
                                       extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs
        out.append(([int(t.split(":")[1]) for t in lp.tokens], lp.token_logprobs, lp.top_logprobs))
    return out


def as_dense(tops, vocab=512):
    ref = np.full(vocab, -np.inf)
    for t, v in tops.items():
        ref[int(t.split(":")[1])] = v
    return ref


def drain_on_sigterm(proc, port, client, name, sig_pid, n_stream=60, n_queued=30):
    """Open a streaming request and queue a second one, SIGTERM, then check both finish, nothing new
    is accepted, and the exit status is 0."""
    queued = {}
    stream = client.completions.create(model=name, prompt="Once", max_tokens=n_stream, stream=True, temperature=0,
                                       logprobs=0, extra_body={"ignore_eos": True})
    first = next(iter(stream))
    t = threading.Thread(target=lambda: queued.update(r=client.completions.create(
        model=name, prompt="Twice", max_tokens=n_queued, temperature=0, extra_body={"ignore_eos": True})))
    t.start()
    time.sleep(0.5)                                  # "Twice" waits for the one slot
    os.kill(sig_pid, signal.SIGTERM)
    # No longer listening soon after the signal (a pod's launcher forwards it first: allow for a
    # loaded host instead of a fixed 0.2 s).
    deadline = time.time() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        except OSError:
            break
        if time.time() > deadline:
            pytest.fail(f"port {port} still accepts connections 10 s after SIGTERM")
        time.sleep(0.1)
    chunks = [first] + list(stream)
    t.join(120)
    text_chunks = [c for c in chunks if c.choices]
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert sum(len(c.choices[0].logprobs.tokens) for c in text_chunks) == n_stream
    assert queued["r"].usage.completion_tokens == n_queued and queued["r"].choices[0].finish_reason == "length"
    assert proc.wait(120) == 0


def test_pod_of_two_processes_serves_like_one(checkpoint, tmp_path):
    port = free_port()
    args = ["configs/base.yml", *checkpoint, *SERVE]
    # The reference: one process, which then drains on SIGTERM.
    one, _ = start([sys.executable, "-m", "k3jax.serve", *args, f"serve_port={port}"], port, tmp_path)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)
        name = client.models.list().data[0].id
        want = greedy(client, name)
        drain_on_sigterm(one, port, client, name, one.pid)
    finally:
        if one.poll() is None:
            os.killpg(one.pid, signal.SIGKILL)
    # Two processes with one device each: a 2-device mesh across processes, process 0 serves HTTP.
    pod, log = start(["bash", "scripts/local_pod.sh", "2", "1", sys.executable, "-m", "k3jax.serve", *args,
                      f"serve_port={port}"], port, tmp_path)
    try:
        for k, ((ids, lps, _), (want_ids, _, want_tops)) in enumerate(zip(greedy(client, name), want)):
            check_greedy(f"prompt {k}: pod vs one process", ids, lps, want_ids, lambda i: as_dense(want_tops[i]))
        drain_on_sigterm(pod, port, client, name, pod.pid, n_stream=8, n_queued=4)
        out = open(log).read()
        assert "Traceback" not in out, out[-4000:]
    finally:
        if pod.poll() is None:
            os.killpg(pod.pid, signal.SIGKILL)
