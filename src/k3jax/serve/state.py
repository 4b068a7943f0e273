"""What every route of one server shares: the engine, the tokenizer and the settings ``create_app``
was given, plus what follows from the tokenizer once (its tool-call format, the token that opens a
tool-call section). It lives on the app as ``app.state.server``; a route reads it from its request
with ``server(request)``, so the routes are plain module-level functions, not a closure.
"""
from __future__ import annotations

import dataclasses
import secrets

from fastapi import Request as HttpRequest

from k3jax.data import k3_chat
from k3jax.data import toolcalls
from k3jax.serve import protocol as proto


@dataclasses.dataclass(frozen=True, eq=False)
class ServerState:
    engine: object                       # serve.engine.Engine (tests pass fakes with the same surface)
    tokenizer: object                    # data.tokenizer.KimiTokenizer
    model_name: str                      # the one name /v1/models lists and requests may ask for
    context: int                         # cache positions per slot: prompt + completion must fit
    api_key: str | None                  # None: no Authorization header wanted
    metrics: object | None               # serve.metrics.ServeMetrics, or None
    images: dict | None                  # a vision model's image settings (create_app); None = text only
    k3: bool                             # K3's XTML format (data/k3_chat.py, data/k3_toolcalls.py)
    grammar: toolcalls.Grammar | None    # K2 / K2.5 / Kimi Linear tool-call markup, if any (None for K3)
    ban_token: int                       # the tool-section opener tool_choice="none" bans (-1: none)
    think_tag: list[int]                 # K3's opening of the think channel ([] for other formats)
    max_n: int                           # n may ask for up to every slot (serve_max_batch)
    stop_ids: frozenset                  # end-of-message tokens: not text in a chat reply

    @classmethod
    def of(cls, engine, tokenizer, *, model_name: str, context: int, api_key: str | None = None,
           metrics=None, images: dict | None = None) -> ServerState:
        k3 = k3_chat.is_k3(tokenizer)
        return cls(engine=engine, tokenizer=tokenizer, model_name=model_name, context=context, api_key=api_key,
                   metrics=metrics, images=images, k3=k3,
                   grammar=None if k3 else toolcalls.Grammar.of(tokenizer),
                   ban_token=toolcalls.ban_token(tokenizer),
                   think_tag=k3_chat.encode(tokenizer, k3_chat.open_tag("think"))[0] if k3 else [],
                   max_n=engine.stats()["slots"], stop_ids=frozenset(getattr(engine, "stop_ids", ())))

    def check_key(self, request: HttpRequest) -> None:
        """401 unless the request carries ``Authorization: Bearer <serve_api_key>`` (when one is set)."""
        if self.api_key is None:
            return
        got = request.headers.get("authorization", "")
        if not (got.startswith("Bearer ") and secrets.compare_digest(got[7:].encode(), self.api_key.encode())):
            raise proto.ApiError(401, "Incorrect API key provided.", code="invalid_api_key")

    def check_model(self, name: str | None) -> None:
        """404 for a model name other than the served one (no name is fine)."""
        if name not in (None, self.model_name):
            raise proto.ApiError(404, f"The model '{name}' does not exist; this server serves '{self.model_name}'.",
                                 param="model", code="model_not_found")


def server(request: HttpRequest) -> ServerState:
    """The state of the app that received ``request``."""
    return request.app.state.server
