"""Multi-host for real: the training run as a pod of 2 processes x 2 CPU devices (scripts/local_pod.sh,
gloo collectives) against one process with 4 devices, reading JSONL data through a glob and a
tokenizer directory. Data, tokenizer, run directory and checkpoints are all on gs:// (the local GCS
server of the ``gcs`` fixture), as on a pod whose hosts share nothing but a bucket.

Three launches in all, chained by module fixtures, of a run of 8 steps (<= 5 steps each, one
compilation cache; the in-process reference and launch 3 share a program, launches 1 and 2 another).
The run is context-parallel with the context axis spanning the two processes (CP: context=2 x
expert=2, so process i holds context slice i of every row): both processes read the one data shard
and each feeds only its half of every sequence (k3jax.feed).
  1. 2 processes, SIGTERM once step 4 is logged: every process agrees on step 5, saves it, process 0
     prints one line, all exit 143; the losses equal the in-process 1 x 4 reference's (the same
     mesh fed whole rows of the same global batches); a profiler trace of step 2 lands in the run
     directory.
  2. the restart as 2 processes: resumes from the preemption checkpoint with each process's data
     iterator state, its losses continue the reference's; SIGTERM again after step 6 (saves 7).
  3. the restart as 1 process x 4 devices: orbax reshards the 2-process checkpoint, the data
     iterator restarts at its step-derived position with a one-line notice (the one shard's, where
     the pod's iterators stood); runs step 8, whose loss is the reference's.
"""
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from helpers import REPO, TINY_TRAIN, tool_env

# The tiny model cut to 4 layers (KDA, MLA, dense, MoE and AttnRes all still present): it compiles
# several times faster, and the pod compiles it on 2 processes at once.
MH = TINY_TRAIN + ["num_layers=4", "mla_every=4", "mla_extra_layers=[]", "attn_res_block_size=2",
                   "async_checkpointing=true", "checkpoint_period=2"]
STEPS = 8
# Context parallelism across the pod's hosts: mesh order (data, fsdp, context, expert, tensor) puts
# process i's two devices at context index i (expert splits the rows within a process); the padded
# all-to-all is the expert-parallel token exchange that runs on CPU (moe_ep_transport=auto picks it
# there). Without remat the train step
# compiles in the CPU time of the fsdp=4 one with full remat (58.5 s vs 54.1 s measured; 79 s with it).
CP = ["ici_fsdp_parallelism=1", "ici_context_parallelism=2", "ici_expert_parallelism=2", "remat_policy=none"]
STEP_LINE = re.compile(r"^\[0\] step (\d+)/\d+  loss ([0-9.]+)")


def pod_cmd(n, d, tool, *args):
    return ["bash", str(REPO / "scripts" / "local_pod.sh"), str(n), str(d), sys.executable, "-m", f"k3jax.{tool}",
            "configs/base.yml", *args]


class Launch:
    """A subprocess whose output lines are collected by a thread; ``wait_for(pattern)``."""

    def __init__(self, cmd, env=None):
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env or tool_env(), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines, self.cond = [], threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            with self.cond:
                self.lines.append(line.rstrip("\n"))
                self.cond.notify_all()

    def wait_for(self, pattern, timeout=900):
        rx = re.compile(pattern)
        deadline = time.time() + timeout
        with self.cond:
            while not any(rx.search(x) for x in self.lines):
                exited = self.proc.poll() is not None
                if not self.cond.wait(1) and exited:
                    raise AssertionError(f"exited ({self.proc.returncode}) before {pattern!r}:\n{self.text()}")
                assert time.time() < deadline, f"no {pattern!r} after {timeout}s:\n{self.text()}"

    def finish(self, timeout=900):
        try:
            rc = self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
        time.sleep(0.2)
        self.seconds = time.perf_counter() - self.t0
        return rc

    def text(self):
        return "\n".join(self.lines[-80:])

    def losses(self):
        return {int(m.group(1)): float(m.group(2)) for x in self.lines if (m := STEP_LINE.match(x))}


def metrics_losses(run_dir):
    import json
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        out[r["step"]] = r["loss"]
    return out


# ---- the data: per-process record sets (no jax) -------------------------------------------------

def test_process_record_sets_are_disjoint_and_cover_the_data(tmp_path):
    """Through the real pipeline (files -> shuffle -> repeat -> tokenize -> pack -> batch), processes
    0 and 1 of 2 read disjoint record sets whose union is the 1-process record set, every epoch."""
    import collections
    import json

    from k3jax.data.pipeline import make_pipeline
    from k3jax.data.tiny_tokenizer import build
    from k3jax.data.tokenizer import KimiTokenizer
    n = 37
    lines = [json.dumps({"text": f"record {i:03d}"}) for i in range(n)]
    (tmp_path / "a.jsonl").write_text("\n".join(lines[:20]) + "\n")
    (tmp_path / "b.jsonl").write_text("\n".join(lines[20:]) + "\n")
    tok = KimiTokenizer.from_dir(build(tmp_path / "tok", vocab_size=512, num_reserved=32))

    def records(pi, pc, epochs):
        """Record ids of every document packed into the batches, in order (each fits a row)."""
        it = make_pipeline(dataset_type="jsonl", paths=str(tmp_path / "*.jsonl"), tokenizer=tok, seq_len=64,
                           batch_size=1, seed=3, process_index=pi, process_count=pc, num_epochs=epochs)
        out = []
        for b in it:
            for seg in range(1, int(b["segment_ids"].max()) + 1):
                ids = b["tokens"][0][b["segment_ids"][0] == seg]
                text = tok.decode([t for t in ids.tolist() if t != tok.eos_id])
                out.append(int(text.split()[1]))
        return out

    one = collections.Counter(records(0, 1, 1))
    assert one == collections.Counter(range(n))           # every record once per epoch
    p0, p1 = set(records(0, 2, 1)), set(records(1, 2, 1))
    assert not p0 & p1 and p0 | p1 == set(range(n))
    two = [collections.Counter(records(i, 2, 2)) for i in range(2)]   # two epochs, reshuffled
    assert set(two[0]) == p0 and set(two[1]) == p1
    assert all(c == 2 for t in two for c in t.values())


# ---- the reference: one process, 4 devices, the pod's global batches ----------------------------

@pytest.fixture(scope="module")
def reference(store):
    """Losses of STEPS train steps on 1 process x 4 devices (same mesh as the pod), each global batch
    = the whole rows of the one data shard (make_pipeline(process_index=0, 1)), put from this
    process whole. The pod's two processes read that shard too, each putting its sequence half."""
    import jax

    from k3jax import config as C
    from k3jax.feed import token_sharding
    from k3jax.sharding import make_mesh
    from k3jax.state import init_state
    from k3jax.data.iterator import data_iterator
    from k3jax.step import check_batch
    from k3jax.train import compile_train_step
    cfg = C.load(C.REPO_CONFIGS / "base.yml", MH + CP + store.args + [f"steps={STEPS}"])
    from k3jax.runtime import load_tokenizer
    tok = load_tokenizer(cfg)
    mesh = make_mesh(cfg, jax.devices()[:4])
    gb = check_batch(cfg, 4)
    assert gb == 4      # rows = 2 per device x 4 devices / context 2: a context group shares its rows
    gdef, state, tx = init_state(cfg, mesh, optimizer=True)
    step = compile_train_step(cfg, gdef, tx, state, mesh, gb)
    it = data_iterator(cfg, gb, tok, shard=0, num_shards=1)
    losses = {}
    for s in range(1, STEPS + 1):
        batch = {k: jax.device_put(v, token_sharding(mesh)) for k, v in next(it).items()}
        with jax.set_mesh(mesh):
            state, m = step(state, batch)
        losses[s] = float(m["loss"])
    return losses


def check_losses(got: dict, want: dict, rtol=1e-6):
    assert got, "no losses"
    for s, v in got.items():
        assert abs(v - want[s]) <= rtol * abs(want[s]), f"step {s}: loss {v!r} vs {want[s]!r} (1 process)"
    worst = max(abs(v - want[s]) / abs(want[s]) for s, v in got.items())
    print(f"steps {sorted(got)}: largest relative loss difference from 1 process {worst:.1e}")   # shown by -rP


# ---- the pod launches ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def store(gcs, tmp_path_factory):
    """The run's inputs and outputs on gs://: JSONL data (two files, a glob), a tokenizer and the run
    root. -> namespace(root=<run root, an epath>, args=[the key=values])."""
    import json
    import types

    from etils import epath

    from k3jax import paths
    from k3jax.data import tiny_tokenizer
    local = tmp_path_factory.mktemp("store")
    tiny_tokenizer.build(local / "tok", vocab_size=512, num_reserved=tiny_tokenizer.MIN_RESERVED)
    rng = np.random.default_rng(0)
    words = ["alice", "rabbit", "queen", "tea", "hatter", "cat", "garden", "door", "key", "little", "said", "very"]
    docs = [json.dumps({"text": " ".join(rng.choice(words, int(rng.integers(4, 30))))}) for _ in range(240)]
    (local / "data").mkdir()
    for i in range(2):
        (local / "data" / f"part-{i}.jsonl").write_text("\n".join(docs[i::2]) + "\n")
    remote = f"{gcs.bucket}/multihost"
    paths.upload(local / "data", f"{remote}/data")
    paths.upload(local / "tok", f"{remote}/tok")
    args = ["dataset_type=jsonl", f"dataset_path={remote}/data/part-*.jsonl", f"tokenizer_path={remote}/tok",
            f"base_output_directory={remote}/runs"]
    return types.SimpleNamespace(root=epath.Path(f"{remote}/runs"), args=args)


@pytest.fixture(scope="module")
def run_root(store):
    return store.root


def preempt_after(store, step, *extra):
    """A 2 x 2 pod of the run, sent SIGTERM once ``step`` is logged."""
    pod = Launch(pod_cmd(2, 2, "train", *MH, *CP, *store.args, "run_name=r", f"steps={STEPS}", *extra))
    pod.wait_for(rf"^\[0\] step {step}/")
    os.kill(pod.proc.pid, signal.SIGTERM)
    return pod, pod.finish()


def check_preempted(pod, rc, run_root, saved_step):
    out = pod.text()
    assert rc == 143, out
    notes = [x for x in pod.lines if "preempted (SIGTERM)" in x]
    assert len(notes) == 1 and notes[0].startswith("[0] "), out        # one line, from process 0
    print(notes[0])
    assert int(re.search(r"checkpoint (\d+) saved", notes[0]).group(1)) == saved_step, out
    step_dir = run_root / "r" / "checkpoints" / str(saved_step)
    assert (step_dir / "commit_success.txt").exists()
    data = sorted(p.name for p in (step_dir / "data").iterdir())
    assert "process_0-of-2.json" in data and "process_1-of-2.json" in data   # per-process iterator state
    import json
    shards = [json.loads((step_dir / "data" / f"process_{i}-of-2.json").read_text())["data_shard"] for i in range(2)]
    assert shards == [[0, 1], [0, 1]]          # one context group: both processes read the one shard
    # process 0 fed rows 0..4 and only positions 0..16 (its context slice) of every row
    assert any("feeding data shard 0 of 1: rows 0..4 of 4, positions 0..16 of 32" in x for x in pod.lines), out
    assert not [x for x in pod.lines if x.startswith("[1] step")]          # only process 0 logs
    assert "Traceback" not in out, out


@pytest.fixture(scope="module")
def preempted(store):
    """Launch 1: 2 x 2 devices from scratch, SIGTERM after step 4; a profile of step 2."""
    return preempt_after(store, 4, "profiler=xplane", "skip_first_n_steps_for_profiler=1", "profiler_steps=1")


def test_sigterm_saves_an_agreed_step_and_exits_143(preempted, run_root, reference):
    pod, rc = preempted
    # signalled after step 4: the processes agree on the next step, save it and stop
    check_preempted(pod, rc, run_root, 5)
    losses = pod.losses()
    assert sorted(losses) == [1, 2, 3, 4, 5]
    assert metrics_losses(run_root / "r") == pytest.approx(losses, rel=1e-4)   # the log's 4 decimals
    check_losses(metrics_losses(run_root / "r"), reference)
    assert [x for x in pod.lines if "wrote a profile of steps 2..2" in x], pod.text()
    from etils import epath

    from k3jax import paths
    traces = paths.glob(f"{run_root}/r/profile/plugins/profile/*/*.xplane.pb")
    assert len(traces) == 1 and epath.Path(traces[0]).read_bytes(), traces   # process 0 traced, uploaded to gs://


@pytest.fixture(scope="module")
def restarted(preempted, store):
    """Launch 2: the job restarted as 2 processes, preempted again after step 6."""
    return preempt_after(store, 6)


def test_restart_as_two_processes_resumes(restarted, run_root, reference):
    pod, rc = restarted
    assert any("resumed from" in x and "at step 5" in x for x in pod.lines), pod.text()
    assert not any("step-derived" in x for x in pod.lines)
    check_preempted(pod, rc, run_root, 7)
    assert sorted(pod.losses()) == [6, 7]
    check_losses(metrics_losses(run_root / "r"), reference)


@pytest.fixture(scope="module")
def elastic(restarted, store):
    """Launch 3: restarted as 1 process x 4 devices from the 2-process checkpoint of step 7."""
    env = tool_env()
    env["XLA_FLAGS"] += " --xla_force_host_platform_device_count=4"
    cmd = [sys.executable, "-m", "k3jax.train", "configs/base.yml", *MH, *CP, *store.args, "run_name=r",
           f"steps={STEPS}"]
    p = Launch(cmd, env)
    return p, p.finish()


def test_restart_as_one_process_reshards(elastic, run_root, reference):
    p, rc = elastic
    assert rc == 0, p.text()
    assert any("resumed from" in x and "at step 7" in x for x in p.lines), p.text()
    notes = [x for x in p.lines if "step-derived position" in x]
    assert len(notes) == 1 and "saved by 2 process(es), this run has 1" in notes[0], p.text()
    # the one data shard's step-derived position is where the pod's iterators were: the reference's batch
    check_losses({STEPS: metrics_losses(run_root / "r")[STEPS]}, reference)
    assert not (REPO / "gs:").exists()   # a gs:// run directory never becomes a local folder
    from k3jax import paths
    objects = paths.glob(f"{run_root}/r/**")
    print(f"the run directory on gs:// holds {len(objects)} objects after 3 launches and {STEPS} steps")


# ---- decode and logit_check as a pod of 2 processes (one launch) -------------------------------

def test_decode_and_logit_check_as_two_processes_match_one(elastic, store, run_root, tmp_path):
    """Launch 4 (the third of 2 processes): decode then logit_check from the run's last checkpoint,
    each printed once (by process 0), the same tokens and logits as this process computes alone."""
    import shlex

    import jax

    from k3jax import config as C
    from k3jax import logit_check
    from k3jax.inference.generate import generate
    from k3jax.runtime import load_tokenizer
    from k3jax.sharding import make_mesh
    from k3jax.state import load_model
    ckpt = run_root / "r" / "checkpoints" / str(STEPS)
    common = MH + store.args + [f"load_parameters_path={ckpt}"]
    dec = common + ["prompt=The cat", "max_new_tokens=8", "stream=false"]
    cfg = C.load(C.REPO_CONFIGS / "base.yml", dec)
    tok = load_tokenizer(cfg)
    mesh = make_mesh(cfg, jax.devices()[:4])
    model = load_model(cfg, mesh)
    with jax.set_mesh(mesh):
        out, _ = generate(model, [tok.encode("The cat", add_bos=True)], max_new_tokens=8,
                          stop_ids=(tok.eos_id, tok.im_end_id))
    new = [t for t in out[0].tolist() if t >= 0 and t not in (tok.eos_id, tok.im_end_id)]
    want_text = "The cat" + tok.decode(new)
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (2, 12)).astype(np.int32)
    np.savez(tmp_path / "golden.npz", tokens=tokens, logits=logit_check.model_logits(cfg, tokens))

    py = shlex.quote(sys.executable)
    script = (f"{py} -m k3jax.decode configs/base.yml {shlex.join(dec)} \"$@\" && "
              f"{py} -m k3jax.logit_check configs/base.yml {shlex.join(common)} golden={tmp_path / 'golden.npz'} "
              f"atol=1e-5 max_kl=1e-8 \"$@\"")
    pod = Launch(["bash", str(REPO / "scripts" / "local_pod.sh"), "2", "2", "bash", "-c", script, "pod"])
    rc = pod.finish()
    assert rc == 0, pod.text()
    assert [x for x in pod.lines if x.startswith("[0] The cat")] == [f"[0] {want_text}"], pod.text()
    assert not [x for x in pod.lines if x.startswith("[1] ") and ("The cat" in x or "PASS" in x)]
    assert sum(x == "[0] PASS" for x in pod.lines) == 1, pod.text()
    err = float(next(x for x in pod.lines if "max |logit error|" in x).split("|")[2].split()[0])
    assert err <= 1e-5, pod.text()
