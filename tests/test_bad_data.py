"""The bad-data policy: a bad record is skipped with a warning naming file:line (the first few,
then only counted), the counts reach the metrics, and too much bad data stops the pipeline with
one DataError, early (the first bad_data_check_records records) or while reading, never a hang."""
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
