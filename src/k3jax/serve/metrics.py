"""Prometheus metrics of the server (``GET /metrics``), in a registry of its own per server (so
two servers in one process, as in the tests, do not share counters)."""
from __future__ import annotations

import collections
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RATE_WINDOW_S = 10.0


class ServeMetrics:
    def __init__(self, stats):
        """``stats()`` -> {"queue", "active", "slots"}, read at each scrape."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue = Gauge("k3jax_queue_length", "requests waiting for a slot", registry=r)
        self.active = Gauge("k3jax_active_slots", "slots holding a request (prefilling or generating)", registry=r)
        self.slots = Gauge("k3jax_slots", "decode slots (serve_max_batch)", registry=r)
        self.rate = Gauge("k3jax_output_tokens_per_second", f"generated tokens per second over the last "
                          f"{RATE_WINDOW_S:.0f} s", registry=r)
        self.out = Counter("k3jax_output_tokens", "generated tokens", registry=r)
        self.requests = Counter("k3jax_requests", "finished requests by outcome", ["outcome"], registry=r)
        self.ttft = Histogram("k3jax_time_to_first_token_seconds", "time from arrival to the first generated "
                              "token", buckets=TTFT_BUCKETS, registry=r)
        self.prefix_hits = Counter("k3jax_prefix_cache_hits", "requests that restored a cached prompt prefix",
                                   registry=r)
        self.prefix_misses = Counter("k3jax_prefix_cache_misses", "requests that found no cached prefix", registry=r)
        self.prefix_evictions = Counter("k3jax_prefix_cache_evictions", "cached prompt prefixes evicted (LRU)",
                                        registry=r)
        self.prefix_reused = Counter("k3jax_prefix_cache_reused_tokens", "prompt tokens restored instead of "
                                     "prefilled", registry=r)
        self.prefix_bytes = Gauge("k3jax_prefix_cache_bytes", "bytes held by the prefix cache", registry=r)
        self.tool_calls = Counter("k3jax_tool_calls", "tool calls returned in chat responses", registry=r)
        self.tool_call_failures = Counter("k3jax_tool_call_parse_failures", "tool-call sections returned as text "
                                          "instead (bad_json, unknown_function, bad_id, unclosed, ...)", ["reason"],
                                          registry=r)
        self._stats = stats
        self._recent: collections.deque = collections.deque()
        self._lock = threading.Lock()

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def tokens(self, n: int) -> None:
        self.out.inc(n)
        with self._lock:
            self._recent.append((time.monotonic(), n))

    def prefix_lookup(self, reused: int) -> None:
        """A prefix cache lookup that restored ``reused`` tokens (0: a miss)."""
        (self.prefix_hits if reused else self.prefix_misses).inc()
        self.prefix_reused.inc(reused)

    def prefix_evicted(self, n: int) -> None:
        self.prefix_evictions.inc(n)

    def finished(self, outcome: str) -> None:
        self.requests.labels(outcome=outcome).inc()

    def parsed(self, calls: int, failures: list[str]) -> None:
        """One chat response's tool calls, and the reasons its malformed sections came back as text."""
        self.tool_calls.inc(calls)
        for reason in failures:
            self.tool_call_failures.labels(reason=reason).inc()

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
                self._recent.popleft()
            n = sum(k for _, k in self._recent)
        return n / RATE_WINDOW_S

    def render(self) -> bytes:
        s = self._stats()
        self.queue.set(s["queue"])
        self.active.set(s["active"])
        self.slots.set(s["slots"])
        self.prefix_bytes.set(s.get("prefix_cache_bytes", 0))
        self.rate.set(self.tokens_per_second())
        return generate_latest(self.registry)
