"""chat_ids: a checkpoint's own chat template (K2 markup) rendered in a sandbox to prompt ids, or K3's
format rendered natively, with every string a message carries kept as ordinary text."""
import pytest

from k3jax.data import chat_template, k3_chat, tiny_tokenizer
from k3jax.data.tokenizer import KimiTokenizer


@pytest.fixture(scope="module")
def k2_dir(tmp_path_factory):
    return tiny_tokenizer.build(tmp_path_factory.mktemp("k2"), vocab_size=512,
                                num_reserved=tiny_tokenizer.MIN_RESERVED)


def test_a_k3_tokenizer_renders_natively_even_with_a_jinja_template(tmp_path):
    """The family decides, not the file: a K3 tokenizer directory that ships a chat_template.jinja is
    rendered by k3_chat (whose goldens are in test_k3_chat.py); the user's marker strings stay text."""
    d = tiny_tokenizer.build(tmp_path, vocab_size=512, num_reserved=tiny_tokenizer.MIN_RESERVED, family="k3")
    (tmp_path / "chat_template.jinja").write_text("{{ 'a template the K3 renderer does not read' }}")
    tok = KimiTokenizer.from_dir(d)
    assert tok.chat_template is not None and tok.im_end_id == tok.token_id("<|end_of_msg|>")
    msgs = [{"role": "user", "content": "hi <|end_of_msg|><|close|> there"},
            {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    ids = chat_template.chat_ids(tok, msgs)
    assert ids == k3_chat.render(tok, msgs)[0] == chat_template.render(tok, msgs)[0]
    text = k3_chat.render_text(msgs)
    assert tok.decode(ids) == text and text.startswith(
        '<|open|>message role="system" type="thinking-effort"<|sep|>')
    sp = tok.special_ids
    assert sum(i == sp["<|end_of_msg|>"] for i in ids) == text.count("<|end_of_msg|>") - 1 == 4
    assert sum(i == sp["<|close|>"] for i in ids) == text.count("<|close|>") - 1


def test_k2_template_equals_builtin_markup(k2_dir):
    tok = KimiTokenizer.from_dir(k2_dir)
    assert tok.chat_template is not None
    for msgs in ([{"role": "user", "content": "hello"}],
                 [{"role": "system", "content": "be brief"}, {"role": "user", "content": "x <|im_end|> y",
                                                              "name": "<|im_user|>bob"}]):
        assert chat_template.chat_ids(tok, msgs) == chat_template.render(tok, msgs)[0]


def test_template_that_rewrites_text(k2_dir):
    tok = KimiTokenizer.from_dir(k2_dir)
    tok.chat_template = tiny_tokenizer.KIMI_CHAT_TEMPLATE.replace(
        "{%- if message['content'] is string -%}{{ message['content'] }}",
        "{%- if message['content'] is string -%}{{ message['content'] | upper }}")
    assert tok.chat_template != tiny_tokenizer.KIMI_CHAT_TEMPLATE
    ids = chat_template.chat_ids(tok, [{"role": "system", "content": "s"}, {"role": "user", "content": "quiet"}])
    assert tok.decode(ids) == ("<|im_system|>system<|im_middle|>S<|im_end|><|im_user|>user<|im_middle|>QUIET"
                               "<|im_end|><|im_assistant|>assistant<|im_middle|>")
    with pytest.raises(ValueError, match="rewrites message text"):
        chat_template.chat_ids(tok, [{"role": "user", "content": "<|im_end|>"}])
