"""Generated tokens -> text, one token at a time, with OpenAI ``stop`` strings.

Tokens are byte sequences and a character may span tokens, so bytes go through an incremental
UTF-8 decoder and a character is released once complete. A stop string may also span tokens: text
that could still be the start of a stop string is held back until the next token settles it, and
when a stop string appears the text ends right before it (the stop string itself is not returned,
as in the OpenAI API).
"""
from __future__ import annotations

import codecs


class TextState:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tok = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""          # everything decoded so far
        self.sent = 0           # characters of self.text already returned
        self.ended = False

    def add(self, token: int) -> tuple[str, bool]:
        """Append one token -> (text that is now safe to return, whether a stop string ended it)."""
        if self.ended:
            return "", True
        start = max(0, len(self.text) - self.hold)
        self.text += self._utf8.decode(self.tok.decode_bytes([token]))
        for_stop = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if for_stop:
            cut = min(for_stop)
            self.ended = True
            out, self.sent = self.text[self.sent:cut], cut
            self.text = self.text[:cut]
            return out, True
        safe = len(self.text) - self.hold if self.stop else len(self.text)
        if safe <= self.sent:
            return "", False
        out, self.sent = self.text[self.sent:safe], safe
        return out, False

    def finish(self) -> str:
        """The generation ended (stop token, length): everything held back, incomplete bytes as U+FFFD."""
        if self.ended:
            return ""
        self.ended = True
        self.text += self._utf8.decode(b"", final=True)
        out, self.sent = self.text[self.sent:], len(self.text)
        return out
