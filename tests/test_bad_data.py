"""The bad-data policy: a bad record is skipped with a warning naming file:line (the first few,
then only counted), the counts reach the metrics, and too much bad data stops the pipeline with
one DataError, early (the first bad_data_check_records records) or while reading, never a hang."""
import json
import logging
import threading

import pytest

from k3jax.data import pipeline as P
from k3jax.data.sources import DataError
from k3jax.data.tokenizer import KimiTokenizer

from helpers import REPO

GOOD, BAD = b'{"text": "a good record with some words"}', b'{"body": "no text field"}'


@pytest.fixture(scope="module")
def tok():
    return KimiTokenizer.from_dir(REPO / "data" / "demo" / "tokenizer")


def _pipe(tok, path, **kw):
    args = dict(dataset_type="jsonl", paths=str(path), tokenizer=tok, seq_len=16, batch_size=2, seed=0,
                shuffle=False, process_index=0, process_count=1, bad_data="skip", read_threads=1, prefetch=4)
    return P.make_pipeline(**{**args, **kw})


def _next_within(it, seconds):
    """next(it) in a thread: the policy must answer (a batch or an error) within ``seconds``."""
    out = {}

    def go():
        try:
            out["batch"] = next(it)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            out["error"] = e
    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"no batch and no error after {seconds} s: the pipeline hangs"
    return out


def test_warnings_are_few_then_counted(tok, tmp_path, caplog):
    lines = [BAD if i % 25 == 3 else GOOD for i in range(500)]          # 20 bad records, 4 %
    path = tmp_path / "some_bad.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    with caplog.at_level(logging.WARNING, logger="k3jax.data.pipeline"):
        it = _pipe(tok, path, num_epochs=1, check_records_first=100, max_bad_fraction=0.5)
        n = sum(1 for _ in it)
    assert n > 0
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == P.MAX_WARNINGS + 1, warnings
    assert f"{path}:4:" in warnings[0] and f"{path}:29:" in warnings[1]
    assert "counted" in warnings[-1]
    assert it.stats.bad_record == 20 and it.stats.records == 500


def test_all_records_bad_stops_at_once_even_without_the_early_check(tok, tmp_path):
    path = tmp_path / "all_bad.jsonl"
    path.write_bytes(b"\n".join([BAD] * 20000) + b"\n")
    with pytest.raises(DataError, match=f"{path}:1: .*'text'"):     # the early check, before any model
        _pipe(tok, path, check_records_first=100, max_bad_fraction=0.5)
    it = _pipe(tok, path, check_records_first=0, max_bad_fraction=0.5)   # no early check: the reader stops
    out = _next_within(it, 20)
    assert isinstance(out.get("error"), DataError), out
    assert "bad_data_max_fraction=0.5" in str(out["error"]) and "text_key='text'" in str(out["error"])


def test_data_turning_bad_after_the_check_stops_the_run(tok, tmp_path):
    path = tmp_path / "turns_bad.jsonl"
    path.write_bytes(b"\n".join([GOOD] * 30 + [BAD] * 5000) + b"\n")
    it = _pipe(tok, path, check_records_first=30, max_bad_fraction=0.5)   # the first 30 are fine
    errors = None
    for _ in range(200):
        out = _next_within(it, 20)
        if "error" in out:
            errors = out["error"]
            break
    assert isinstance(errors, DataError) and "malformed" in str(errors), errors
    assert it.stats.records < 200       # stopped soon after the fraction passed one half


def test_no_document_in_the_first_records(tok, tmp_path):
    path = tmp_path / "blank.jsonl"
    path.write_bytes(b'{"text": "   "}\n' * 50)
    with pytest.raises(DataError, match=r"none of the first 50 records .* \(0 malformed, 50 empty\)"):
        _pipe(tok, path, check_records_first=100, max_bad_fraction=0.5)


def test_mm_sft_bad_records_are_counted_and_named(tmp_path, caplog):
    """dataset_type=mm_sft under the same rule: a missing image, an unreadable one (bad_image) and a
    marker count that is not the image count (bad_record) are skipped with their path:line, the good
    records train; under bad_data=fatal the first is one DataError naming its place and file."""
    from PIL import Image

    from k3jax import config as C
    from k3jax.data import mm_sft
    from k3jax.data.vision_processor import from_config
    cfg = C.load(C.REPO_CONFIGS / "base.yml", ["model_name=tiny", "vision_enabled=true", "vision_patch_buckets=[16]"])
    Image.new("RGB", (28, 28), (200, 10, 10)).save(tmp_path / "ok.png")
    (tmp_path / "broken.png").write_bytes(b"\x89PNG not really")

    def conv(images, text):
        return {"images": images, "messages": [{"role": "user", "content": text},
                                               {"role": "assistant", "content": "red"}]}
    recs = [conv(["ok.png"], "<image>?"), conv(["gone.png"], "<image>?"), conv(["broken.png"], "<image>?"),
            conv(["ok.png"], "<image> <image>?"), conv(["ok.png"], "<image>!")]
    path = tmp_path / "mm.json"
    path.write_text(json.dumps(recs, indent=1))
    lines = [i + 1 for i, line in enumerate(path.read_text().splitlines()) if line == " {"]
    tok = KimiTokenizer.from_dir(REPO / "data" / "demo" / "tokenizer")
    kw = dict(paths=str(path), tokenizer=tok, seq_len=64, batch_size=1, seed=0,
              shuffle=False, process_index=0, process_count=1, num_epochs=1, vcfg=cfg.vision, pcfg=from_config(cfg),
              read_threads=1, prefetch=4)
    with caplog.at_level(logging.WARNING, logger="k3jax.data.pipeline"):
        it = mm_sft.make_pipeline(bad_data="skip", **kw)
        assert len(list(it)) == 2
    assert (it.stats.bad_image, it.stats.bad_record, it.stats.docs, it.stats.bad) == (2, 1, 2, 3)
    got = [r.getMessage() for r in caplog.records]
    assert f"{path}:{lines[1]}: {tmp_path / 'gone.png'}: image file not found" in got[0]
    assert f"{path}:{lines[2]}: {tmp_path / 'broken.png'}: unreadable image" in got[1]
    assert f"{path}:{lines[3]}: 2 <image> markers but 1 images" in got[2]
    with pytest.raises(DataError, match=f"{path}:{lines[1]}: .*gone.png: image file not found"):
        list(mm_sft.make_pipeline(bad_data="fatal", **kw))


def test_no_record_fits_the_row_says_so(tok, tmp_path):
    """SFT conversations that are all longer than the row (sft_overlong=drop) are not "empty": the
    error names the length and what to raise."""
    import json
    path = tmp_path / "long.jsonl"
    rec = {"messages": [{"role": "user", "content": "word " * 40}, {"role": "assistant", "content": "yes"}]}
    path.write_text((json.dumps(rec) + "\n") * 20)
    with pytest.raises(DataError, match=r"none of the first 20 records .*: 20 are longer than max_target_length=16 "
                                        r"and cannot be cut to fit \(sft_overlong=drop\), 0 malformed, 0 empty; "
                                        r"raise max_target_length"):
        _pipe(tok, path, dataset_type="sft", sft_overlong="drop", check_records_first=100)
