"""Prometheus metrics of one server (its own registry, so several apps can live in one process).

Engine gauges are read from the AsyncEngine's latest Snapshot at scrape time; latencies are
observed by the request handlers as outputs reach them (what a client sees, minus the network).

Besides jpa's own names, the engine state is exported under vLLM's names, which routers and
autoscalers read (labelled with model_name, as vLLM does): `vllm:num_requests_running`,
`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` (a fraction in [0, 1] despite the name;
pages held by requests, cached-idle pages count as free as in vLLM), and the counters
`vllm:prefix_cache_queries` / `vllm:prefix_cache_hits` (prompt tokens looked up in the prefix
cache / found there; exposed with Prometheus' `_total` suffix). With speculative decoding, vLLM's
`vllm:spec_decode_num_drafts`, `vllm:spec_decode_num_draft_tokens`,
`vllm:spec_decode_num_accepted_tokens` and `vllm:spec_decode_num_accepted_tokens_per_pos`
(labelled with the draft position) count verify steps with drafts, drafts verified and accepted.
`vllm:num_preemptions` counts preemptions. With KV offload (--kv-offload-memory), the
`jpa_kv_offload_*` family (vLLM has no names for it) counts preempted requests swapped out to the
host tier and back in, the pages and bytes copied each way and the tokens not recomputed, the
prefix-cache pages spilled to the host tier and restored from it (pages, bytes), with the host
tier's size, free and spilled pages as gauges. Host-tier prefix hits are vLLM's
`vllm:external_prefix_cache_queries` / `vllm:external_prefix_cache_hits` (vLLM counts its KV
connectors' hits, e.g. CPU offload, there: prompt tokens looked up past the device's hit / served
from the host tier), and `vllm:prefix_cache_hits` then counts the device's hits alone, as vLLM's.
"""

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jpa.engine.async_engine import AsyncEngine

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)


class _EngineCollector:
    def __init__(self, get_engine: Callable[[], AsyncEngine | None], model_name: str):
        self.get_engine, self.model_name = get_engine, model_name

    def collect(self):
        engine = self.get_engine()
        if engine is None:   # the model is still loading
            g = GaugeMetricFamily("jpa_engine_alive", "1 while the engine thread runs")
            g.add_metric([], 0.0)
            yield g
            return
        yield from self._vllm(engine)
        s = engine.snapshot
        gauges = [
            ("jpa_num_requests_running", "requests holding a decode slot", s.num_running),
            ("jpa_num_requests_waiting", "requests accepted and not running yet", s.num_waiting),
            ("jpa_kv_pages_used", "KV cache pages in use (read back from the device)", s.pages_used),
            ("jpa_prefix_cache_pages", "KV pages held by the prefix cache alone (evictable)", s.cached_pages),
            ("jpa_kv_pages_total", "KV cache pages in the pool", s.num_pages),
            ("jpa_kv_cache_usage_ratio", "fraction of KV pages in use", s.pages_used / max(s.num_pages, 1)),
            ("jpa_generation_tokens_per_second", "generated tokens per second over the last "
             f"{engine.rate_window:g} s (0 when idle)", s.tokens_per_s),
            ("jpa_kv_pool_whole", "1 when the engine is idle and every KV page is free (checked on the "
             "device), else 0", 1.0 if s.pool_whole else 0.0),
            ("jpa_last_abort_release_rounds", "engine rounds between the latest abort's arrival and the "
             "release of its pages (-1: none yet)", s.last_abort_rounds),
            ("jpa_engine_alive", "1 while the engine thread runs", 1.0 if s.alive else 0.0),
        ]
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float(value))
            yield g
        for name, doc, value in (("jpa_engine_rounds", "engine rounds (step calls)", s.rounds),
                                 ("jpa_prompt_tokens", "prompt tokens accepted by the engine", s.prompt_tokens),
                                 ("jpa_generation_tokens", "tokens generated", s.generation_tokens),
                                 ("jpa_compilations", "programs compiled (decode loop, prefill shapes)",
                                  s.compilations),
                                 ("jpa_compile_seconds", "time spent compiling", s.compile_seconds)):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], float(value))
            yield c

    def _vllm(self, engine: AsyncEngine):
        s = engine.snapshot
        label = (["model_name"], [self.model_name])
        for name, doc, value in (
                ("vllm:num_requests_running", "Number of requests in model execution batches.", s.num_running),
                ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting),
                ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                 s.pages_used / max(s.num_pages, 1))):
            g = GaugeMetricFamily(name, doc, labels=label[0])
            g.add_metric(label[1], float(value))
            yield g
        # The prefix cache's running totals (plain ints the engine thread adds to; read as they are).
        prefix = getattr(getattr(engine.engine, "scheduler", None), "prefix", None)
        queries, hits = (prefix.query_tokens, prefix.hit_tokens - prefix.host_hit_tokens) if prefix is not None else (0, 0)
        counters = [
                ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", queries),
                ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", hits)]
        if prefix is not None and prefix.host is not None:   # KV offload: the host tier's prefix hits
            counters += [
                ("vllm:external_prefix_cache_queries", "External prefix cache queries from KV connector cross-"
                 "instance cache sharing, in terms of number of queried tokens.", prefix.host_query_tokens),
                ("vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector cross-instance "
                 "cache sharing, in terms of number of cached tokens.", prefix.host_hit_tokens)]
        for name, doc, value in counters:
            c = CounterMetricFamily(name, doc, labels=label[0])
            c.add_metric(label[1], float(value))
            yield c
        inner = getattr(engine, "engine", None)
        st = getattr(inner, "stats", None)   # running sums the engine thread adds to (read as they are)
        if st is not None:
            c = CounterMetricFamily("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                                    labels=label[0])
            c.add_metric(label[1], float(st.preemptions))
            yield c
            yield from self._offload(inner, st)
        if getattr(getattr(inner, "config", None), "speculative", None) is None:
            return
        for name, doc, value in (
                ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", st.spec_drafts),
                ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", st.spec_draft_tokens),
                ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", st.spec_accepted_tokens)):
            c = CounterMetricFamily(name, doc, labels=label[0])
            c.add_metric(label[1], float(value))
            yield c
        c = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                                labels=["model_name", "position"])
        for pos, value in enumerate(list(st.spec_accepted_per_pos)):
            c.add_metric([self.model_name, str(pos)], float(value))
        yield c


    @staticmethod
    def _offload(inner, st):
        """KV offload's counters and the host tier's gauges (nothing when offload is off)."""
        tier = getattr(inner, "host_tier", None)
        if tier is None:
            return
        for name, doc, value in (
                ("jpa_kv_offload_swapped_out", "preempted requests whose KV pages went to the host tier",
                 st.swapped_out),
                ("jpa_kv_offload_swapped_in", "admissions whose KV pages came back from the host tier", st.swapped_in),
                ("jpa_kv_offload_pages_out", "KV pages copied device -> host", st.swap_out_pages),
                ("jpa_kv_offload_pages_in", "KV pages copied host -> device", st.swap_in_pages),
                ("jpa_kv_offload_bytes_out", "bytes copied device -> host", st.swap_out_bytes),
                ("jpa_kv_offload_bytes_in", "bytes copied host -> device", st.swap_in_bytes),
                ("jpa_kv_offload_recompute_avoided_tokens", "tokens restored from the host tier instead of "
                 "prefilled again", st.recompute_avoided_tokens),
                ("jpa_kv_offload_spilled_pages", "prefix-cache pages copied device -> host when evicted", st.spill_pages),
                ("jpa_kv_offload_spill_bytes", "bytes of spilled prefix-cache pages", st.spill_bytes),
                ("jpa_kv_offload_restored_pages", "spilled prefix-cache pages copied back host -> device on a hit",
                 st.restore_pages),
                ("jpa_kv_offload_restore_bytes", "bytes of restored prefix-cache pages", st.restore_bytes)):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], float(value))
            yield c
        for name, doc, value in (("jpa_kv_offload_host_pages", "pages of the host tier", tier.num_pages),
                                 ("jpa_kv_offload_host_pages_free", "free pages of the host tier", tier.num_free),
                                 ("jpa_kv_offload_host_spilled_pages", "host-tier pages holding spilled prefix-cache "
                                  "pages", len(tier.spilled))):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float(value))
            yield g


class ServerMetrics:
    """The server's registry: engine gauges plus request latency histograms and counters.

    Args:
      get_engine: returns the AsyncEngine, or None while the model loads.
      model_name: the served model's name (the model_name label of vLLM's metrics).
    """

    def __init__(self, get_engine: Callable[[], AsyncEngine | None], model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(get_engine, model_name))
        r = self.registry
        self.ttft = Histogram("jpa_time_to_first_token_seconds", "arrival to the first generated token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("jpa_inter_token_latency_seconds", "time between successive outputs of a request "
                             "(one output carries the tokens of one engine round)", buckets=_LATENCY_BUCKETS,
                             registry=r)
        self.e2e = Histogram("jpa_e2e_request_latency_seconds", "arrival to the last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.finished = Counter("jpa_requests", "requests ended, by finish reason", ["finish_reason"], registry=r)
        self.errors = Counter("jpa_http_errors", "error responses, by HTTP status", ["status"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class Timing:
    """Latency bookkeeping of one request group (arrival -> first token -> ... -> last token)."""

    def __init__(self, metrics: ServerMetrics, arrival: float):
        self.metrics, self.arrival = metrics, arrival
        self.last: dict[int, float] = {}

    def on_output(self, index: int, out) -> None:
        now = time.monotonic()
        m = self.metrics
        if out.new_token_ids:
            if index not in self.last:
                m.ttft.observe(now - self.arrival)
            else:
                m.itl.observe(now - self.last[index])
            self.last[index] = now
        if out.finished:
            m.finished.labels(out.output.finish_reason).inc()
            if out.output.finish_reason in ("stop", "length"):
                m.e2e.observe(now - self.arrival)
