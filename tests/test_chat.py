"""chat_ids: a checkpoint's own chat template (K3 or K2 markup) rendered in a sandbox to prompt ids,
with every string a message carries kept as ordinary text."""
import json

import pytest

from k3jax.data import chat_template, tiny_tokenizer
from k3jax.data.tokenizer import KimiTokenizer

# A stand-in for K3's template (the released file is not available offline): the K3 control
# tokens (formats.md §3.4) in a tag-structured turn, assistant turns closed by <|end_of_msg|>.
K3_TEMPLATE = (
    "{%- for m in messages -%}"
    "<|open|>{{ m['role'] }}<|sep|>{{ m['content'] }}"
    "{%- if m['role'] == 'assistant' -%}<|end_of_msg|>{%- endif -%}<|close|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|open|>assistant<|sep|>{%- endif -%}")
K3_NAMES = {2: "<|end_of_msg|>", 3: "<|open|>", 4: "<|close|>", 5: "<|sep|>"}


@pytest.fixture(scope="module")
def k2_dir(tmp_path_factory):
    return tiny_tokenizer.build(tmp_path_factory.mktemp("k2"), vocab_size=512,
                                num_reserved=tiny_tokenizer.MIN_RESERVED)


def _k3_dir(k2_dir, tmp_path, template=K3_TEMPLATE):
    """The tiny tokenizer renamed like K3's block, its template in chat_template.jinja."""
    cfg = json.loads(open(f"{k2_dir}/tokenizer_config.json").read())
    n_base = min(int(i) for i in cfg["added_tokens_decoder"])
    for off, name in K3_NAMES.items():
        cfg["added_tokens_decoder"][str(n_base + off)]["content"] = name
    for i, entry in cfg["added_tokens_decoder"].items():      # K2-only names become reserved
        if entry["content"].startswith("<|im_"):
            entry["content"] = f"<|reserved_token_{i}|>"
    del cfg["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "tiktoken.model").write_bytes(open(f"{k2_dir}/tiktoken.model", "rb").read())
    (tmp_path / "chat_template.jinja").write_text(template)
    return KimiTokenizer.from_dir(tmp_path)


def test_k3_markup_from_the_checkpoint_template(k2_dir, tmp_path):
    tok = _k3_dir(k2_dir, tmp_path)
    assert tok.im_end_id == tok.token_id("<|end_of_msg|>")       # the stop token of K3 chat
    msgs = [{"role": "user", "content": "hi <|end_of_msg|><|close|> there"},
            {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    ids = chat_template.chat_ids(tok, msgs)
    sp = tok.special_ids
    want = ([sp["<|open|>"]] + tok.encode("user") + [sp["<|sep|>"]] + tok.encode("hi <|end_of_msg|><|close|> there")
            + [sp["<|close|>"], sp["<|open|>"]] + tok.encode("assistant") + [sp["<|sep|>"]] + tok.encode("ok")
            + [sp["<|end_of_msg|>"], sp["<|close|>"], sp["<|open|>"]] + tok.encode("user") + [sp["<|sep|>"]]
            + tok.encode("more") + [sp["<|close|>"], sp["<|open|>"]] + tok.encode("assistant") + [sp["<|sep|>"]])
    assert ids == want
    # The user's special-token strings stayed text: exactly the template's own control tokens.
    assert sum(i == sp["<|end_of_msg|>"] for i in ids) == 1 and sum(i == sp["<|close|>"] for i in ids) == 3


def test_k2_template_equals_builtin_markup(k2_dir):
    tok = KimiTokenizer.from_dir(k2_dir)
    assert tok.chat_template is not None
    for msgs in ([{"role": "user", "content": "hello"}],
                 [{"role": "system", "content": "be brief"}, {"role": "user", "content": "x <|im_end|> y",
                                                              "name": "<|im_user|>bob"}]):
        assert chat_template.chat_ids(tok, msgs) == chat_template.render(tok, msgs)[0]


def test_template_that_rewrites_text(k2_dir, tmp_path):
    tok = _k3_dir(k2_dir, tmp_path, K3_TEMPLATE.replace("{{ m['content'] }}", "{{ m['content'] | upper }}"))
    ids = chat_template.chat_ids(tok, [{"role": "user", "content": "quiet"}])
    assert tok.decode(ids) == "<|open|>user<|sep|>QUIET<|close|><|open|>assistant<|sep|>"
    with pytest.raises(ValueError, match="rewrites message text"):
        chat_template.chat_ids(tok, [{"role": "user", "content": "<|sep|>"}])
