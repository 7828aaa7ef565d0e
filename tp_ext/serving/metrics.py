"""``GET /metrics``: the server's Prometheus metrics (prometheus_client, a registry per server so
two servers in one process do not share counts). Gauges read the engines' counts (summed over
data-parallel replicas) when scraped."""

from __future__ import annotations

__all__ = ["ServerMetrics"]

# seconds: from a few milliseconds (a decode step of a small model) to a long prefill
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    def __init__(self, loop):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = registry = CollectorRegistry()
        gauges = {
            "tp_ext_requests_running": ("requests in the running batch", "running"),
            "tp_ext_requests_waiting": ("requests queued for the batch", "waiting"),
            "tp_ext_kv_cache_blocks_used": (
                "KV-cache blocks requests hold",
                "kv_cache_blocks_used",
            ),
            "tp_ext_kv_cache_blocks_total": ("KV-cache blocks in all", "kv_cache_blocks_total"),
            "tp_ext_preemptions": ("requests preempted for blocks so far", "preemptions"),
        }
        for name, (doc, key) in gauges.items():
            Gauge(name, doc, registry=registry).set_function(lambda key=key: loop.stats()[key])
        self.requests = Counter("tp_ext_requests", "requests received", registry=registry)
        self.generated = Counter("tp_ext_generated_tokens", "tokens generated", registry=registry)
        self.first_token = Histogram(
            "tp_ext_time_to_first_token_seconds", "from arrival to the first token",
            buckets=LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip
        self.inter_token = Histogram(
            "tp_ext_inter_token_latency_seconds", "between a request's tokens",
            buckets=LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip

    def token(self, seconds: float, first: bool) -> None:
        self.generated.inc()
        (self.first_token if first else self.inter_token).observe(seconds)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
