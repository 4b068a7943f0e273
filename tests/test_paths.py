"""gs:// paths against a local GCS server (the ``gcs`` session fixture), in-process: the path
module, data globs, the tokenizer, the converter gs:// -> gs://, logit_check's golden, and the
one-line error for a scheme k3jax does not support."""
import json
from pathlib import Path

import numpy as np
import pytest

from k3jax import config as C
from k3jax import paths

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("key,value", [("base_output_directory", "s3://bucket/runs"),
                                       ("dataset_path", "data/a.jsonl,hdfs://nn/data/*.jsonl"),
                                       ("tokenizer_path", "az://c/tok"), ("load_parameters_path", "s3://b/ckpt")])
def test_unsupported_scheme_is_a_one_line_config_error(key, value):
    with pytest.raises(C.ConfigError) as e:
        C.load(C.REPO_CONFIGS / "base.yml", [f"{key}={value}"])
    msg = str(e.value)
    assert "\n" not in msg and key in msg and "not supported" in msg and "gs://" in msg
    with pytest.raises(C.ConfigError):
        paths.path("s3://bucket/x", key)


def test_gs_paths_globs_and_jsonl_records_match_local(gcs, tmp_path):
    from k3jax.data.sources import JsonlSource
    lines = [json.dumps({"text": f"doc {i} " + "x" * i}) for i in range(9)]
    for name, part in (("a.jsonl", lines[:4]), ("sub/b.jsonl", lines[4:])):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("\n".join(part) + "\n")
    root = f"{gcs.bucket}/paths-test"
    assert paths.upload(tmp_path, root) == 2
    assert paths.glob(f"{root}/**/*.jsonl") == [f"{root}/a.jsonl", f"{root}/sub/b.jsonl"]
    assert paths.glob(str(tmp_path / "**" / "*.jsonl")) == [str(tmp_path / "a.jsonl"), str(tmp_path / "sub/b.jsonl")]
    remote, local = JsonlSource(f"{root}/a.jsonl,{root}/sub/*.jsonl"), JsonlSource(f"{tmp_path}/a.jsonl,{tmp_path}/sub/*.jsonl")
    assert len(remote) == len(local) == 9
    assert [remote[i][0] for i in range(9)] == [local[i][0] for i in range(9)]
    assert remote[5][1] == f"{root}/sub/b.jsonl:2"
    with pytest.raises(Exception, match="no file matches"):
        JsonlSource(f"{root}/nothing-*.jsonl")
    p = paths.path(f"{root}/x/y.txt")
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("hello")
    assert paths.path(f"{root}/x").is_dir() and p.read_text() == "hello"


def test_gs_tokenizer_dir_is_a_local_copy(gcs, tmp_path, monkeypatch):
    from k3jax.data.tiny_tokenizer import build
    from k3jax.runtime import load_tokenizer
    monkeypatch.setenv("K3JAX_CACHE", str(tmp_path / "cache"))
    d = build(tmp_path / "tok", vocab_size=512, num_reserved=32)
    paths.upload(d, f"{gcs.bucket}/tok-test")
    cfg = C.load(C.REPO_CONFIGS / "base.yml", ["vocab_size=512", f"tokenizer_path={gcs.bucket}/tok-test"])
    tok = load_tokenizer(cfg)
    from k3jax.data.tokenizer import KimiTokenizer
    want = KimiTokenizer.from_dir(d)
    assert tok.encode("The cat sat.") == want.encode("The cat sat.") and tok.vocab_size == want.vocab_size


def test_convert_gs_to_gs_and_logit_check_a_gs_golden(gcs, tmp_path):
    """The tiny Kimi Linear HF checkpoint converted from gs:// to gs:// holds the arrays a local
    conversion holds; logit_check reads its golden .npz from gs://."""
    import orbax.checkpoint as ocp

    from conversion.hf_to_k3jax import convert
    from k3jax import logit_check
    asset = REPO / "tests" / "assets" / "kimi_linear_tiny"
    hf, out = f"{gcs.bucket}/hf/kimi_linear_tiny", f"{gcs.bucket}/converted/kl"
    paths.upload(asset, hf)
    summary = convert(hf, out, dtype="float32", progress=False)
    convert(str(asset), str(tmp_path / "local"), dtype="float32", progress=False)
    assert summary["uploaded_files"] > 5 and paths.path(f"{out}/model.yml").exists()
    got = ocp.StandardCheckpointer().restore(paths.path(f"{out}/params"))
    want = ocp.StandardCheckpointer().restore(tmp_path / "local" / "params")
    import jax
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    golden, src = f"{gcs.bucket}/golden.npz", tmp_path / "golden.npz"
    rng = np.random.default_rng(0)
    np.savez(src, tokens=rng.integers(0, 64, (2, 5)), logits=rng.standard_normal((2, 5, 64)).astype(np.float32))
    paths.upload(src, golden)
    tokens, logits = logit_check.load_golden(golden, 64)
    with np.load(src) as g:
        np.testing.assert_array_equal(logits, g["logits"])
        np.testing.assert_array_equal(tokens, g["tokens"])
