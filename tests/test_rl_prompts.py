"""RL prompt sets (k3jax.rl.prompts): JSONL and Parquet records rendered through the chat template (K3
and K2) or as raw text, places kept for errors, every bad record an error naming file:line (and the
field a reward needs), the rollout budget against max_target_length, per-process slices and
shuffled epochs through grain. Tiny tokenizers, no model."""
import dataclasses
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from k3jax import config as C
from k3jax.data import chat_template, tiny_tokenizer
from k3jax.data.sources import DataError
from k3jax.data.tokenizer import KimiTokenizer
from k3jax.rl import prompts as P
from k3jax.rl import rewards as R

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
RECORDS = [
    {"prompt": "Largest digit: 3 8 5 1?", "answer": "8"},
    {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS,
     "tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}, "answer": "sunny"},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}], "answer": 4},
]
FIELDS = {"answer": "exact_match"}


@pytest.fixture(scope="module", params=["k3", "k2"])
def tok(request, tmp_path_factory):
    return KimiTokenizer.from_dir(tiny_tokenizer.build(tmp_path_factory.mktemp(request.param), vocab_size=512,
                                                       num_reserved=tiny_tokenizer.MIN_RESERVED,
                                                       family=request.param))


BASE = C.load(C.REPO_CONFIGS / "base.yml", ["dataset_type=jsonl", "dataset_path=unused", "max_target_length=1024"])


def cfg_of(path, fmt="jsonl", **kw):
    """BASE with these keys replaced (no config load per case: 0.15 s each)."""
    sections: dict = {}
    for key, value in {"dataset_type": fmt, "dataset_path": str(path), **kw}.items():
        sections.setdefault(C.KEYS[key][0], {})[key] = value
    return dataclasses.replace(BASE, **{s: dataclasses.replace(getattr(BASE, s), **v) for s, v in sections.items()})


ONE = dict(process_index=0, process_count=1)


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def render(tok, fields=FIELDS, max_new_tokens=16, max_target_length=256):
    return P.RenderPrompt(tok, fields=fields, max_new_tokens=max_new_tokens, max_target_length=max_target_length)


def test_jsonl_prompts_render_with_the_chat_template(tok, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", RECORDS)
    ds = P.prompt_dataset(cfg_of(tmp_path / "none.jsonl", eval_dataset_path=path), tok, FIELDS, held_out=True, **ONE)
    got = [ds[i] for i in range(len(ds))]
    assert [p.where for p in got] == [f"{path}:{i}" for i in (1, 2, 3)]
    assert got[0].ids == tuple(tok.encode(RECORDS[0]["prompt"])) and got[0].tools == ()
    assert got[1].ids == tuple(chat_template.chat_ids(tok, RECORDS[1]["messages"], tools=TOOLS))
    assert got[1].tools == ("get_weather",) and got[1].record == RECORDS[1]
    assert got[2].ids == tuple(chat_template.chat_ids(tok, RECORDS[2]["messages"]))
    assert P.check_prompts(cfg_of(path), tok, FIELDS, **ONE) == 3


def test_parquet_prompts_keep_their_rows(tok, tmp_path):
    rows = {"prompt": [RECORDS[0]["prompt"], None], "answer": ["8", "4"],
            "messages": [None, json.dumps(RECORDS[2]["messages"])], "tools": [None, None]}
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table(rows), path, row_group_size=1)
    ds = P.prompt_dataset(cfg_of(path, "parquet", data_shuffle=False), tok, FIELDS, **ONE)
    a, b = ds[0], ds[1]
    assert (a.where, b.where) == (f"{path}:row 0", f"{path}:row 1")
    assert a.ids == tuple(tok.encode(RECORDS[0]["prompt"])) and a.record["answer"] == "8"
    assert b.ids == tuple(chat_template.chat_ids(tok, RECORDS[2]["messages"]))
    nested = tmp_path / "nested.parquet"
    pq.write_table(pa.table({"messages": [RECORDS[2]["messages"]], "answer": ["4"]}), nested)
    with pytest.raises(DataError, match=r"nested.parquet: columns \['messages'\] are nested; store messages"):
        P.PromptSource(str(nested), "parquet")


@pytest.mark.parametrize("line,fragment", [
    ('{"prompt": "x"}', "no field 'answer', which the reward 'exact_match' reads"),
    ('{"prompt": "x", "answer": null}', "no field 'answer', which the reward 'exact_match' reads"),
    ('{"answer": "8"}', "needs exactly one of 'prompt' (text) and 'messages' (a chat), got neither"),
    ('{"prompt": "x", "messages": [{"role": "user", "content": "y"}], "answer": 1}',
     "got ['prompt', 'messages']"),
    ('{"prompt": "x", "answer": 1', "not a JSON object"),
    ('[1, 2]', "a record must be a JSON object"),
    ('', "not a JSON object"),
    ('{"prompt": 3, "answer": 1}', "'prompt' must be a non-empty string"),
    ('{"messages": [], "answer": 1}', "'messages' must be a non-empty list"),
    ('{"messages": [{"role": "robot", "content": "y"}], "answer": 1}', "messages: "),
    ('{"prompt": "x", "tools": [], "answer": 1}', "'tools' are declared through the chat template"),
    ('{"messages": [{"role": "user", "content": "y"}], "tools": [{"name": "f"}], "answer": 1}',
     "tools[0] must be"),
    ('{"prompt": "' + "word " * 1200 + '", "answer": 1}', "+ rl_max_new_tokens=16 exceed max_target_length=1024"),
])
def test_a_bad_record_is_an_error_naming_its_line(tok, tmp_path, line, fragment):
    path = write_jsonl(tmp_path / "bad.jsonl", [RECORDS[0], line])
    assert P.check_prompts(cfg_of(path), tok, FIELDS, limit=1, **ONE) == 1
    with pytest.raises(DataError) as e:
        P.check_prompts(cfg_of(path), tok, FIELDS, **ONE)
    assert str(e.value).startswith(f"{path}:2: ") and fragment in str(e.value), str(e.value)


def test_reward_fields_come_from_the_configured_rewards(tok, tmp_path):
    """The prompt set is checked against what the configured rewards read, named by reward."""
    path = write_jsonl(tmp_path / "p.jsonl", [RECORDS[1], RECORDS[0]])
    cfg = cfg_of(path, rl_rewards=["format", "tool_call"])
    fields = R.RewardSet.from_config(cfg.rl).fields
    assert fields == {"tool_call": "tool_call"}
    with pytest.raises(DataError, match=r"p.jsonl:2: no field 'tool_call', which the reward 'tool_call' reads"):
        P.check_prompts(cfg, tok, fields, **ONE)


def test_rollout_budget_is_prompt_plus_max_new_tokens(tok):
    n = len(tok.encode(RECORDS[0]["prompt"]))
    item = (json.dumps(RECORDS[0]).encode(), "p.jsonl:1")
    assert render(tok, max_new_tokens=4, max_target_length=n + 4)(item).ids      # fits exactly
    with pytest.raises(DataError, match=f"p.jsonl:1: the prompt's {n} tokens \\+ rl_max_new_tokens=5 exceed "
                                        f"max_target_length={n + 4}"):
        render(tok, max_new_tokens=5, max_target_length=n + 4)(item)


def test_processes_slice_and_epochs_reshuffle(tok, tmp_path):
    recs = [{"prompt": f"question {i}", "answer": str(i)} for i in range(10)]
    path = write_jsonl(tmp_path / "p.jsonl", recs)
    cfg = cfg_of(path, data_seed=3)
    mine = [P.prompt_dataset(cfg, tok, FIELDS, process_index=k, process_count=2) for k in (0, 1)]
    epoch = [[mine[k][i].record["answer"] for i in range(5)] for k in (0, 1)]
    assert sorted(epoch[0]) == ["0", "2", "4", "6", "8"] and sorted(epoch[1]) == ["1", "3", "5", "7", "9"]
    assert epoch[0] != sorted(epoch[0], key=int) or epoch[1] != sorted(epoch[1], key=int)     # shuffled
    second = [mine[0][i].record["answer"] for i in range(5, 10)]
    assert sorted(second) == sorted(epoch[0]) and second != epoch[0]            # each epoch anew
    again = P.prompt_dataset(cfg, tok, FIELDS, process_index=0, process_count=2)
    assert [again[i].record["answer"] for i in range(10)] == epoch[0] + second  # a restart sees the same
    once = P.prompt_dataset(cfg_of(path, num_epoch=1, data_shuffle=False), tok, FIELDS, process_index=1,
                            process_count=2)
    assert [once[i].record["answer"] for i in range(len(once))] == ["1", "3", "5", "7", "9"]
    assert P.check_prompts(cfg, tok, FIELDS, process_index=1, process_count=2) == 5


def test_only_jsonl_or_parquet(tmp_path, tok):
    with pytest.raises(C.ConfigError, match="RL prompts are read from jsonl or parquet files, not 'sft'"):
        P.prompt_dataset(cfg_of(write_jsonl(tmp_path / "p.jsonl", RECORDS), "sft"), tok, FIELDS, **ONE)
    with pytest.raises(C.ConfigError, match="held-out RL prompts need eval_dataset_path"):
        P.prompt_dataset(cfg_of(tmp_path / "p.jsonl"), tok, FIELDS, held_out=True, **ONE)
    with pytest.raises(DataError, match="no file matches"):
        P.PromptSource(str(tmp_path / "none*.jsonl"), "jsonl")
