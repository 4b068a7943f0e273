"""grain pipelines: packing contract, determinism, exact resume, host sharding, bad data,
Parquet / ArrayRecord / SFT / HellaSwag."""
import collections
import json
import logging
import os

import numpy as np
import pytest

from k3jax.data import chat_template, sft, tiny_tokenizer
from k3jax.data.pipeline import make_pipeline, pipeline_stats, split_document
from k3jax.data.sources import DataError, JsonlSource, SyntheticSource
from k3jax.data.tokenizer import KimiTokenizer

ASSETS = os.path.join(os.path.dirname(__file__), "assets")
KEYS = {"tokens": np.int32, "targets": np.int32, "segment_ids": np.int32,
        "positions": np.int32, "loss_mask": np.float32}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return KimiTokenizer.from_dir(tiny_tokenizer.build(tmp_path_factory.mktemp("tiny"),
                                                       vocab_size=1024))


def _pipe(**kw):
    args = dict(dataset_type="synthetic", paths=None, tokenizer=None, seq_len=32, batch_size=4,
                seed=0, shuffle=True, process_index=0, process_count=1, bad_data="skip",
                vocab_size=97)
    args.update(kw)
    return make_pipeline(**args)


def _write_jsonl(path, texts):
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    return str(path)


def check_batch(b, batch_size, seq_len):
    """The batch contract of k3jax.data.pipeline, checked row by row."""
    assert set(b) == set(KEYS)
    for k, dt in KEYS.items():
        assert b[k].shape == (batch_size, seq_len) and b[k].dtype == dt, k
    for r in range(batch_size):
        seg, pos = b["segment_ids"][r], b["positions"][r]
        tokens, targets, loss = b["tokens"][r], b["targets"][r], b["loss_mask"][r]
        n = int((seg > 0).sum())
        assert (seg[n:] == 0).all() and (seg[:n] > 0).all()  # padding only at the tail
        assert (tokens[n:] == 0).all() and (targets[n:] == 0).all() and (loss[n:] == 0).all()
        assert seg[0] == 1 and set(np.diff(seg[:n])) <= {0, 1}  # 1, 1, 2, 2, 2, 3 ...
        starts = np.r_[True, seg[1:n] != seg[:n - 1]]
        assert (pos[:n][starts] == 0).all()
        assert (pos[1:n][~starts[1:]] == pos[:n - 1][~starts[1:]] + 1).all()
        # last[t]: token t ends its segment, so it has no target within the segment
        last = np.r_[seg[1:n] != seg[:n - 1], True]
        assert (targets[:n - 1][~last[:-1]] == tokens[1:n][~last[:-1]]).all()
        assert (loss[:n][last] == 0).all() and (targets[:n][last] == 0).all()


def segments(batches, key="tokens"):
    """Every packed segment as a tuple of `key` values."""
    out = []
    for b in batches:
        for r in range(b["tokens"].shape[0]):
            seg = b["segment_ids"][r]
            for s in range(1, seg.max() + 1):
                out.append(tuple(b[key][r][seg == s].tolist()))
    return out


def learned_targets(tok, batches):
    """Per segment, the decoded targets the loss is taken on."""
    out = []
    for b in batches:
        for r in range(b["tokens"].shape[0]):
            for s in range(1, b["segment_ids"][r].max() + 1):
                sel = (b["segment_ids"][r] == s) & (b["loss_mask"][r] > 0)
                out.append(tok.decode(b["targets"][r][sel]))
    return out


# ------------------------------------------------------------------ packing contract
def test_split_document():
    tokens = np.arange(10, 20, dtype=np.int32)
    pieces = split_document(tokens, np.ones(10, np.float32), 4)
    assert [p["tokens"].tolist() for p in pieces] == [[10, 11, 12, 13], [14, 15, 16, 17],
                                                     [18, 19]]
    assert pieces[0]["targets"].tolist() == [11, 12, 13, 0]
    assert pieces[0]["loss_mask"].tolist() == [1, 1, 1, 0]
    assert pieces[2]["targets"].tolist() == [19, 0]
    # a 1-token tail has no target and is dropped; SFT weights shift onto the predictor.
    w = np.array([0, 0, 1, 1, 0, 1, 0, 0, 1], np.float32)
    pieces = split_document(tokens[:9], w, 4)
    assert [p["loss_mask"].tolist() for p in pieces] == [[0, 1, 1, 0], [1, 0, 0, 0]]
    assert [p["tokens"].tolist() for p in pieces] == [[10, 11, 12, 13], [14, 15, 16, 17]]
    assert split_document(tokens[:4], np.zeros(4, np.float32), 4) == []


def test_synthetic_batches_follow_the_contract():
    it = _pipe()
    for _ in range(3):
        b = next(it)
        check_batch(b, 4, 32)
        # synthetic documents learn every in-segment next token
        same = (b["segment_ids"][:, 1:] == b["segment_ids"][:, :-1]) & (b["segment_ids"][:, 1:] > 0)
        assert (b["loss_mask"][:, :-1] == same).all()
        assert b["tokens"].max() < 97
    assert (b["segment_ids"].max(axis=1) > 1).any()  # several documents per row
    assert (b["segment_ids"] == 0).mean() < 0.3


def test_synthetic_documents_are_learnable_patterns():
    src = SyntheticSource(vocab_size=50, seed=3, min_len=8, max_len=40)
    assert np.array_equal(src[5], SyntheticSource(vocab_size=50, seed=3, min_len=8,
                                                  max_len=40)[5])
    for i in range(40):
        assert src[i].dtype == np.int32
        d = src[i].astype(np.int64)
        assert 8 <= len(d) <= 40 and 0 <= d.min() and d.max() < 50
        step = (d[1] - d[0]) % 50
        arithmetic = step in (1, 2, 3) and ((np.diff(d) % 50) == step).all()
        periodic = any((d[p:] == d[:-p]).all() for p in range(2, 9))
        assert arithmetic or periodic, d


def test_packing_keeps_documents_whole(tok, tmp_path):
    texts = [f"document {i}: " + "word " * (i % 7) for i in range(40)]
    texts.append("long " * 60)  # longer than seq_len: split
    path = _write_jsonl(tmp_path / "docs.jsonl", texts)
    it = make_pipeline(dataset_type="jsonl", paths=path, tokenizer=tok, seq_len=24,
                       batch_size=1, seed=0, shuffle=False, process_index=0, process_count=1,
                       bad_data="skip", num_epochs=1, num_packing_bins=4)
    batches = list(it)  # batch_size 1: drop_remainder drops nothing
    for b in batches:
        check_batch(b, 1, 24)
    got = collections.Counter(segments(batches))
    want = collections.Counter()
    for t in texts:
        ids = tok.encode(t) + [tok.eos_id]
        for s in range(0, len(ids), 24):
            if len(ids[s:s + 24]) > 1:
                want[tuple(ids[s:s + 24])] += 1
    assert got == want
    assert max(len(b["segment_ids"][0]) - (b["segment_ids"][0] == 0).sum()
               for b in batches) == 24
    stats = pipeline_stats(it)
    assert stats["split_docs"] == 1 and stats["docs"] == 41 and stats["skipped"] == 0


# ------------------------------------------------------------------ determinism / resume
def test_same_seed_same_batches():
    a = [next(it) for it in [_pipe(seed=1)] for _ in range(3)]
    b = [next(it) for it in [_pipe(seed=1)] for _ in range(3)]
    c = next(_pipe(seed=2))
    for x, y in zip(a, b):
        for k in KEYS:
            assert np.array_equal(x[k], y[k])
    assert not np.array_equal(a[0]["tokens"], c["tokens"])


def _resume_check(make, skip=3, take=4):
    it = make()
    for _ in range(skip):
        next(it)
    state = it.get_state()
    want = [next(it) for _ in range(take)]
    fresh = make()
    fresh.set_state(state)
    got = [next(fresh) for _ in range(take)]
    for x, y in zip(want, got):
        for k in KEYS:
            assert np.array_equal(x[k], y[k]), k


def test_resume_synthetic():
    _resume_check(lambda: _pipe(seed=4, synthetic_len=(4, 70)))  # includes split documents


def test_resume_text_across_epochs(tok, tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [f"text number {i} " * (1 + i % 5)
                                               for i in range(30)])
    _resume_check(lambda: make_pipeline(
        dataset_type="jsonl", paths=path, tokenizer=tok, seq_len=16, batch_size=2, seed=7,
        shuffle=True, process_index=0, process_count=1, bad_data="skip"), skip=9, take=6)


def test_orbax_checkpoint_of_the_iterator(tmp_path):
    import grain
    import orbax.checkpoint as ocp

    it = _pipe(seed=5)
    for _ in range(2):
        next(it)
    with ocp.CheckpointManager(tmp_path / "ckpt",
                               item_handlers={"data": grain.checkpoint.CheckpointHandler()}) as m:
        m.save(2, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
        m.wait_until_finished()
    want = [next(it) for _ in range(3)]
    fresh = _pipe(seed=5)
    with ocp.CheckpointManager(tmp_path / "ckpt",
                               item_handlers={"data": grain.checkpoint.CheckpointHandler()}) as m:
        m.restore(m.latest_step(),
                  args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(fresh)))
    for x in want:
        y = next(fresh)
        assert all(np.array_equal(x[k], y[k]) for k in KEYS)


# ------------------------------------------------------------------ host sharding
def test_hosts_read_disjoint_records(tok, tmp_path):
    texts = [f"record {i}" for i in range(23)]
    path = _write_jsonl(tmp_path / "r.jsonl", texts)
    seen = []
    for host in range(3):
        it = make_pipeline(dataset_type="jsonl", paths=path, tokenizer=tok, seq_len=64,
                           batch_size=1, seed=0, shuffle=True, process_index=host,
                           process_count=3, bad_data="skip", num_epochs=1)
        seen.append({tok.decode(s[:-1]) for s in segments(list(it))})
    assert all(not (seen[i] & seen[j]) for i in range(3) for j in range(i + 1, 3))
    assert set.union(*seen) == set(texts)
    assert [len(s) for s in seen] == [8, 8, 7]


# ------------------------------------------------------------------ bad data
BAD_LINES = [
    b'{"text": "good one"}',
    b'{"text": ""}',                       # 2: empty
    b'{"text": "cut',                      # 3: invalid JSON
    b'{"text": "bad \xff\xfe bytes"}',     # 4: invalid UTF-8
    b'{"body": "no text key"}',            # 5: wrong shape
    b"",                                   # 6: blank line -> empty
    b'{"text": "   \\n  "}',               # 7: whitespace only -> empty
    b'{"text": "' + b"too long " * 20 + b'"}',  # 8: split into pieces
    b'{"text": "good two"}',
]


def _bad_file(tmp_path, lines=BAD_LINES):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return str(path)


def test_bad_data_skip_counts_and_reports(tok, tmp_path, caplog):
    path = _bad_file(tmp_path)
    with caplog.at_level(logging.WARNING, logger="k3jax.data.pipeline"):
        it = make_pipeline(dataset_type="jsonl", paths=path, tokenizer=tok, seq_len=16,
                           batch_size=1, seed=0, shuffle=False, process_index=0,
                           process_count=1, bad_data="skip", num_epochs=1)
        batches = list(it)
    stats = pipeline_stats(it)
    assert {k: stats[k] for k in ("records", "docs", "empty", "bad_json", "bad_utf8",
                                  "bad_record", "split_docs", "skipped")} == {
        "records": 9, "docs": 3, "empty": 3, "bad_json": 1, "bad_utf8": 1, "bad_record": 1,
        "split_docs": 1, "skipped": 6}
    assert it.stats.skipped == 6
    msgs = " ".join(r.getMessage() for r in caplog.records)
    for line in (3, 4, 5):
        assert f"{path}:{line}" in msgs
    texts = {tok.decode(s) for s in segments(batches)}
    assert "good one[EOS]" in texts and "good two[EOS]" in texts
    long_ids = tok.encode("too long " * 20) + [tok.eos_id]
    assert stats["pieces"] == 2 + -(-len(long_ids) // 16)


@pytest.mark.parametrize("lines,where,why", [
    (BAD_LINES, ":3", "invalid JSON"),
    ([BAD_LINES[0], BAD_LINES[3]], ":2", "invalid UTF-8"),
    ([BAD_LINES[4]], ":1", "'text'"),
])
def test_bad_data_fatal_names_file_and_line(tok, tmp_path, lines, where, why):
    path = _bad_file(tmp_path, lines)
    it = make_pipeline(dataset_type="jsonl", paths=path, tokenizer=tok, seq_len=16,
                       batch_size=1, seed=0, shuffle=False, process_index=0, process_count=1,
                       bad_data="fatal", num_epochs=1)
    with pytest.raises(DataError, match=f"{path}{where}: .*{why}"):
        list(it)


def test_jsonl_source_and_globs(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(b'{"text": "x"}\r\n{"text": "y"}')  # CRLF, no final \n
    (tmp_path / "b.jsonl").write_bytes(b"")
    src = JsonlSource(str(tmp_path / "*.jsonl"))
    assert len(src) == 2
    assert src[0] == (b'{"text": "x"}', f"{tmp_path}/a.jsonl:1")
    assert src[1] == (b'{"text": "y"}', f"{tmp_path}/a.jsonl:2")
    with pytest.raises(DataError, match="no file matches"):
        JsonlSource(str(tmp_path / "missing*.jsonl"))


# ------------------------------------------------------------------ Parquet / ArrayRecord
def test_parquet_source(tok, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [f"parquet row {i}" for i in range(7)]
    pq.write_table(pa.table({"text": rows[:5] + [None], "id": list(range(6))}),
                   tmp_path / "p0.parquet", row_group_size=2)
    pq.write_table(pa.table({"text": rows[5:]}), tmp_path / "p1.parquet")
    it = make_pipeline(dataset_type="parquet", paths=str(tmp_path / "*.parquet"),
                       tokenizer=tok, seq_len=32, batch_size=1, seed=0, shuffle=True,
                       process_index=0, process_count=1, bad_data="skip", num_epochs=1)
    got = {tok.decode(s[:-1]) for s in segments(list(it))}
    assert got == set(rows)
    assert pipeline_stats(it)["empty"] == 1  # the null cell
    from k3jax.data.sources import ParquetSource
    src = ParquetSource(str(tmp_path / "*.parquet"))
    assert src[3] == ("parquet row 3", f"{tmp_path}/p0.parquet:row 3")
    assert src[7] == ("parquet row 6", f"{tmp_path}/p1.parquet:row 1")


def test_arrayrecord_source(tok, tmp_path):
    ar = pytest.importorskip("array_record.python.array_record_module")
    path = str(tmp_path / "d.array_record")
    writer = ar.ArrayRecordWriter(path, "group_size:1")
    records = [b"plain text record", json.dumps({"text": "json record"}).encode(),
               b"{not json", "unicode ✓ record".encode(), b"\xff\xfe"]
    for r in records:
        writer.write(r)
    writer.close()
    it = make_pipeline(dataset_type="arrayrecord", paths=path, tokenizer=tok, seq_len=32,
                       batch_size=1, seed=0, shuffle=False, process_index=0, process_count=1,
                       bad_data="skip", num_epochs=1)
    got = {tok.decode(s[:-1]) for s in segments(list(it))}
    assert got == {"plain text record", "json record", "unicode ✓ record"}
    stats = pipeline_stats(it)
    assert (stats["bad_json"], stats["bad_utf8"]) == (1, 1)
    fatal = make_pipeline(dataset_type="arrayrecord", paths=path, tokenizer=tok, seq_len=32,
                          batch_size=1, seed=0, shuffle=False, process_index=0,
                          process_count=1, bad_data="fatal", num_epochs=1)
    with pytest.raises(DataError, match=f"{path}:record 2"):
        list(fatal)


# ------------------------------------------------------------------ SFT and HellaSwag
def test_sft_loss_only_on_assistant_tokens(tok, tmp_path):
    convs = [[{"role": "user", "content": f"question {i}?"},
              {"role": "assistant", "content": f"answer {i}."}] for i in range(6)]
    path = tmp_path / "sft.jsonl"
    path.write_text("\n".join(json.dumps({"messages": c}) for c in convs) + "\n"
                    + json.dumps({"messages": [{"role": "user", "content": "no reply"}]}) + "\n"
                    + json.dumps({"messages": "oops"}) + "\n")
    it = make_pipeline(dataset_type="sft", paths=str(path), tokenizer=tok, seq_len=128,
                       batch_size=1, seed=0, shuffle=False, process_index=0, process_count=1,
                       bad_data="skip", num_epochs=1)
    batches = list(it)
    for b in batches:
        check_batch(b, 1, 128)
    learned = set(learned_targets(tok, batches))
    assert learned == {f"answer {i}.<|im_end|>" for i in range(6)}
    stats = pipeline_stats(it)
    assert (stats["docs"], stats["empty"], stats["bad_record"]) == (6, 1, 1)


def test_hellaswag_messages():
    with open(os.path.join(ASSETS, "hellaswag_sample.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 20
    for row in rows:
        user, assistant = sft.hellaswag_to_messages(row)
        assert user["role"] == "user" and assistant["role"] == "assistant"
        assert row["ctx"] in user["content"]
        for letter, ending in zip("ABCD", row["endings"]):
            assert f"{letter}. {ending}" in user["content"]
        assert assistant["content"] == row["endings"][row["label"]]
    as_string = dict(rows[0], label="2")
    assert sft.hellaswag_to_messages(as_string)[1]["content"] == rows[0]["endings"][2]
    with pytest.raises(ValueError, match="label"):
        sft.hellaswag_to_messages(dict(rows[0], label=4))
    with pytest.raises(ValueError, match="4 endings"):
        sft.hellaswag_to_messages(dict(rows[0], endings=["a"]))


def test_hellaswag_sft_pipeline(tok):
    path = os.path.join(ASSETS, "hellaswag_sample.jsonl")
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    it = make_pipeline(dataset_type="sft", paths=path, tokenizer=tok, seq_len=512,
                       batch_size=2, seed=0, shuffle=True, process_index=0, process_count=1,
                       bad_data="fatal", num_epochs=1, sft_format="hellaswag")
    batches = list(it)
    for b in batches:
        check_batch(b, 2, 512)
    learned = learned_targets(tok, batches)
    want = {r["endings"][r["label"]] + "<|im_end|>" for r in rows}
    assert sorted(learned) == sorted(want)  # every row learned once, only its answer
    assert pipeline_stats(it)["docs"] == 20
    prompt = sft.hellaswag_prompt(tok, rows[0])
    assert tok.decode(prompt).endswith("<|im_assistant|>assistant<|im_middle|>")
    full, _ = chat_template.render(tok, sft.hellaswag_to_messages(rows[0]),
                                   add_generation_prompt=False)
    assert full[:len(prompt)] == prompt


# ---- dataset_type=mm_sft: image conversations (k3jax.data.mm_sft) -----------------------------------

@pytest.fixture(scope="module")
def mm(tmp_path_factory):
    """The demo tokenizer (it has the media tokens), the tiny tower's config with one 32-patch
    bucket, and a directory of images: a.png 28x28 (4 patches), b.png 56x28 (8), c.png 28x28."""
    from PIL import Image

    from k3jax import config as C
    from k3jax.data.vision_processor import from_config
    cfg = C.load(C.REPO_CONFIGS / "base.yml", ["model_name=tiny", "vocab_size=1024", "vision_enabled=true",
                                                "vision_patch_buckets=[32]"])
    root = tmp_path_factory.mktemp("mm")
    (root / "img").mkdir()
    rng = np.random.default_rng(0)
    for name, (w, h) in {"a": (28, 28), "b": (56, 28), "c": (28, 28)}.items():
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / "img" / f"{name}.png")
    tokd = os.path.join(os.path.dirname(__file__), "..", "data", "demo", "tokenizer")
    return collections.namedtuple("MM", "tok vcfg pcfg root")(KimiTokenizer.from_dir(tokd), cfg.vision,
                                                               from_config(cfg), root)


def _conv(images, question, answer):
    return {"images": images, "messages": [{"role": "user", "content": question},
                                           {"role": "assistant", "content": answer}]}


def _mm_pipe(mm, paths, **kw):
    from k3jax.data import mm_sft
    args = dict(paths=str(paths), tokenizer=mm.tok, seq_len=64, batch_size=2, seed=0,
                shuffle=False, process_index=0, process_count=1, bad_data="fatal", num_epochs=1,
                vcfg=mm.vcfg, pcfg=mm.pcfg, sft_default_system=None, read_threads=1, prefetch=4)
    return mm_sft.make_pipeline(**{**args, **kw})


def test_mm_sft_batches_carry_their_images_in_pad_order(mm):
    """A JSON list (MindSpeed-MM's layout, paths relative to the file) and a JSONL file read through
    image_root: one conversation per row, each row's media packed on their own in the order of
    their pads (``slots``: the pads' columns), patches equal to the processor's, loss only on the
    answers, shapes fixed by the per-row patch bucket (a text-only row and batch included)."""
    from k3jax.data.vision_processor import process_image
    from k3jax.data.media import media_token_ids
    from k3jax.data.media_layout import DROP
    recs = [_conv(["img/a.png", "img/b.png"], "<image> and <image>: same?", "no"),
            _conv([], "plain text", "yes"),
            _conv(["img/c.png"], "what is <image>?", "noise"),
            _conv([], "more text", "ok")]
    (mm.root / "list.json").write_text(json.dumps(recs, indent=2))
    (mm.root / "sub").mkdir(exist_ok=True)
    (mm.root / "sub" / "lines.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    pad = media_token_ids(mm.tok)[2]
    for paths, kw in ((mm.root / "list.json", {}), (mm.root / "sub" / "lines.jsonl", {"image_root": str(mm.root)})):
        batches = list(_mm_pipe(mm, paths, **kw))
        assert len(batches) == 2
        first, second = batches
        check_batch({k: v for k, v in first.items() if k not in ("media", "media_grids")}, 2, 64)
        assert first["media_grids"].tolist() == [list(process_image(mm.root / "img" / f"{n}.png", mm.pcfg).grid_thw)
                                                 for n in "ab"]
        where = np.flatnonzero(first["tokens"][0] == pad)
        assert len(where) == 1 + 2 and not (first["tokens"][1] == pad).any()   # a: 1 token, b: 2; row 1 text
        slots = first["media"]["slots"]
        assert slots.shape == (2, 8) and slots[0, :3].tolist() == where.tolist()
        assert (slots[0, 3:] == DROP).all() and (slots[1] == DROP).all()
        want = np.concatenate([process_image(mm.root / "img" / f"{n}.png", mm.pcfg).patches for n in "ab"])
        assert first["media"]["patches"].shape == (2, 32, 588)
        np.testing.assert_array_equal(first["media"]["patches"][0, :12], want)
        assert not first["media"]["patches"][0, 12:].any() and not first["media"]["patches"][1].any()
        assert {k: v.shape[0] for k, v in first["media"].items()} == dict.fromkeys(first["media"], 2)
        assert (second["tokens"] == pad).sum() == 1 and second["media"]["patches"].shape == (2, 32, 588)
        learned = sorted(learned_targets(mm.tok, batches))
        assert learned == sorted(f"{a}<|im_end|>" for a in ("no", "yes", "noise", "ok"))


def test_mm_sft_overlong_is_cut_only_after_the_images(mm, caplog):
    """sft_overlong=truncate never cuts through a media run: a conversation whose image ends inside
    the row is truncated; one whose image would be cut is dropped, counted and logged with path:line."""
    long_answer = " ".join(["word"] * 60)
    recs = [_conv(["img/a.png"], "<image>", long_answer),
            _conv(["img/b.png"], "x " * 40 + "<image>", "short")]
    (mm.root / "long.json").write_text(json.dumps(recs, indent=1))
    with caplog.at_level(logging.WARNING, logger="k3jax.data.mm_sft"):
        it = _mm_pipe(mm, mm.root / "long.json", batch_size=1, seq_len=48)
        batches = list(it)
    assert len(batches) == 1 and (batches[0]["tokens"] != 0).sum() == 48
    assert (it.stats.sft_truncated, it.stats.sft_dropped) == (1, 1)
    assert any(f"{mm.root / 'long.json'}:" in r.getMessage() and "never cut through an image" in r.getMessage()
               for r in caplog.records)


def test_mm_sft_resumes_the_same_batches(mm):
    recs = [_conv([f"img/{'ac'[i % 2]}.png"], "<image> #%d" % i, f"answer {i}") for i in range(12)]
    (mm.root / "resume.json").write_text(json.dumps(recs))
    it = _mm_pipe(mm, mm.root / "resume.json", shuffle=True, num_epochs=None)
    next(it)
    state = it.get_state()
    want = [next(it) for _ in range(3)]
    it2 = _mm_pipe(mm, mm.root / "resume.json", shuffle=True, num_epochs=None)
    it2.set_state(state)
    for w in want:
        g = next(it2)
        np.testing.assert_array_equal(g["tokens"], w["tokens"])
        np.testing.assert_array_equal(g["media"]["patches"], w["media"]["patches"])


def test_mm_sft_image_paths():
    from k3jax.data.mm_sft import resolve_image
    assert resolve_image("x/a.jpg", "/data/set/train.json:17", None) == "/data/set/x/a.jpg"
    assert resolve_image("x/a.jpg", "gs://b/set/train.json:3", None) == "gs://b/set/x/a.jpg"
    assert resolve_image("x/a.jpg", "/data/set/train.json:1", "gs://b/coco") == "gs://b/coco/x/a.jpg"
    assert resolve_image("/abs/a.jpg", "/data/t.json:1", "gs://b/coco") == "/abs/a.jpg"
