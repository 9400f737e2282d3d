"""The server's Prometheus metrics: the engine's state read when scraped, and counters and latency
histograms that ``EngineLoop`` feeds as tokens arrive."""

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from runtime.engine import Engine

# Seconds, from a decode step of a tiny model on the CPU to a long prompt's queueing under load.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
                   10.0, 20.0, 40.0, 80.0)


class ServingMetrics:
    """One registry per server, so that servers in one process keep their own figures."""

    def __init__(self, engine: Engine, num_submitted: Callable[[], int]):
        """``num_submitted``: requests handed to the engine loop that it has not taken in yet."""
        self.registry = registry = CollectorRegistry()
        scheduler, blocks = engine.scheduler, engine.block_manager
        Gauge("zoo:num_requests_running", "Requests in the running batch.",
              registry=registry).set_function(lambda: len(scheduler.running))
        Gauge("zoo:num_requests_waiting", "Requests waiting to be admitted.",
              registry=registry).set_function(lambda: len(scheduler.waiting) + num_submitted())
        Gauge("zoo:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = all).",
              registry=registry).set_function(lambda: 1 - blocks.num_free_blocks / blocks.num_blocks)
        self.prompt_tokens = Counter("zoo:prompt_tokens", "Prompt tokens of requests that produced a token.",
                                     registry=registry)
        self.generation_tokens = Counter("zoo:generation_tokens", "Generated tokens.", registry=registry)
        self.time_to_first_token = Histogram("zoo:time_to_first_token_seconds",
                                             "From a request's arrival to its first token.",
                                             buckets=LATENCY_BUCKETS, registry=registry)
        self.inter_token_latency = Histogram("zoo:inter_token_latency_seconds",
                                             "Between consecutive tokens of a request.",
                                             buckets=LATENCY_BUCKETS, registry=registry)

    def exposition(self) -> bytes:
        """The metrics in Prometheus' text format."""
        return generate_latest(self.registry)
