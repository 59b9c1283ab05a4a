"""Every Prometheus metric the sidecar exports, on one injected registry.

Names follow Prometheus practice: ``cancel_sidecar_`` prefix, base units, ``_total`` on counters,
low-cardinality labels (route prefix, engine name, outcome, phase, verdict; never a request id
or a host).
"""

from __future__ import annotations

from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

# Seconds; abort latency is expected in milliseconds, time to first byte up to minutes.
_FAST_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# Seconds an upgraded connection (a WebSocket session) lasted: a refused handshake to hours.
_TUNNEL_BUCKETS = (0.01, 0.1, 1.0, 10.0, 30.0, 60.0, 300.0, 900.0, 1800.0, 3600.0, 14400.0)
_CALL_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128)
_TTFB_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


_Metric = TypeVar("_Metric", bound=MetricWrapperBase)


class Metrics:
    """The sidecar's metrics, registered on ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._children: dict[tuple[int, tuple[str, ...]], MetricWrapperBase] = {}
        self.requests = Counter(
            "cancel_sidecar_requests_total",
            "Downstream requests finished, by route prefix and status class (2xx..5xx, or "
            "'disconnected' when the client left first, 'cancelled' when the sidecar ended it: "
            "the cancel API, a deadline, or a stop after the grace period).",
            ["route", "status_class"], registry=registry)
        self.in_flight = Gauge(
            "cancel_sidecar_in_flight_requests", "Downstream requests being proxied now.",
            ["route"], registry=registry,
            # --workers N: the sum over live worker processes (sidecar.workers).
            multiprocess_mode="livesum")
        self.disconnects = Counter(
            "cancel_sidecar_client_disconnects_total",
            "Clients that disconnected before their response was complete, by phase "
            "(request_body, before_first_byte, awaiting_response, streaming).",
            ["route", "phase"], registry=registry)
        self.cancelled = Counter(
            "cancel_sidecar_cancelled_requests_total",
            "Requests ended through the cancel API (POST /v1/requests/{id}/cancel on the admin "
            "listener), by route prefix and phase (as for client_disconnects_total).",
            ["route", "phase"], registry=registry)
        self.deadline_exceeded = Counter(
            "cancel_sidecar_deadline_exceeded_total",
            "Requests ended because their deadline passed (routes[].max_duration_s, or the "
            "client's shorter X-Sidecar-Deadline-S), by route prefix and phase (as for "
            "client_disconnects_total).",
            ["route", "phase"], registry=registry)
        self.abort_calls = Counter(
            "cancel_sidecar_abort_calls_total",
            "HTTP calls to an engine abort endpoint (one call carries the ids of many requests; "
            "each attempt of a retried call counts, re-sends too), by engine and outcome "
            "(accepted: answered 2xx, which does not say the engine knew the ids; "
            "http_<status>, timeout, error).",
            ["engine", "outcome"], registry=registry)
        self.abort_resent_ids = Counter(
            "cancel_sidecar_abort_resent_ids_total",
            "Engine request ids named again in abort re-sends, by engine: a request that ended "
            "within engines.*.abort.resend_window_s of the engine getting its whole body has "
            "its ids re-sent while the engine may still be registering them (an engine ignores "
            "an abort for an id it does not know yet).",
            ["engine"], registry=registry)
        self.abort_late_starts = Counter(
            "cancel_sidecar_abort_late_starts_total",
            "Streams whose engine began them only after their abort confirmation's bound (it "
            "registered the request late), by engine: their ids were named again then "
            "(engines.*.abort.late_start_s). Many: the engine registers requests slowly; raise "
            "resend_window_s.",
            ["engine"], registry=registry)
        self.aborted_requests = Counter(
            "cancel_sidecar_aborted_requests_total",
            "Requests whose engine ids the sidecar set out to abort, by engine and the final "
            "outcome. Engine kinds that confirm (vllm, sglang): confirmed (the engine ended the "
            "request's response aborted), finished (it ended on its own first), unconfirmed "
            "(nothing ended within engines.*.abort.confirm_timeout_s: alert on it). Other kinds: "
            "accepted (the first call that carried them was answered 2xx, not proof that it "
            "stopped anything). Any kind: http_<status>, timeout, error (the first call failed, "
            "after its retries); dropped (the engine's abort queue was full, never sent); "
            "cancelled (the sidecar stopped first). Re-sends are not counted here.",
            ["engine", "outcome"], registry=registry)
        self.recovered = Counter(
            "cancel_sidecar_recovered_requests",
            "Requests a dead sidecar process left running at an engine, aborted on its behalf "
            "(sidecar.inflight): reason worker_died (by the supervisor, --workers) or "
            "found_at_start (by the next start, before it listens).",
            ["engine", "reason"], registry=registry)
        self.unabortable = Counter(
            "cancel_sidecar_unabortable_requests_total",
            "Requests that ended early (client disconnect, cancel API, deadline, shutdown, "
            "upstream timeout) after the engine had them whole, at an engine that aborts by id, "
            "while it may still run them under ids the sidecar cannot know: no abort call, "
            "only the upstream connection closed (for body_over_replay_buffer on a route whose "
            "ids are counted from the body: only the ids named without it aborted). By engine "
            "and reason (sglang_n_samples, vllm_beam_search, body_over_replay_buffer). Kind "
            "openai (close-only) never counts.",
            ["engine", "reason"], registry=registry)
        self.kept = Counter(
            "cancel_sidecar_kept_requests_total",
            "Requests that ended early while their engine keeps running them on purpose after "
            "the client leaves, so they were never aborted, only their upstream connection "
            "closed. By engine and reason (background_response: POST /v1/responses with "
            "background true; response_retrieval: GET /v1/responses/{id}). Not a loss.",
            ["engine", "reason"], registry=registry)
        self.header_targets = Counter(
            "cancel_sidecar_header_abort_targets_total",
            "Requests that ended early with a routes[].abort_from_header header (llm-d's "
            "x-prefiller-host-port), by route prefix and verdict: allowed (that engine was "
            "aborted too), or why it was refused and never called (several_values, userinfo, "
            "scheme, path, malformed, not_allowed).",
            ["route", "verdict"], registry=registry)
        self.abort_latency = Histogram(
            "cancel_sidecar_abort_latency_seconds",
            "Per request whose abort was accepted: time from the sidecar noticing its client's "
            "disconnect to the engine's 2xx answer to the first call that carried its ids.",
            ["engine"], buckets=_FAST_BUCKETS, registry=registry)
        self.abort_confirm_latency = Histogram(
            "cancel_sidecar_abort_confirm_seconds",
            "Per request whose abort the engine confirmed: time from the sidecar noticing its "
            "client's disconnect to the engine ending the request's response aborted (read on "
            "its upstream connection: sidecar.confirm).",
            ["engine"], buckets=_FAST_BUCKETS, registry=registry)
        self.abort_calls_per_request = Histogram(
            "cancel_sidecar_abort_calls_per_request",
            "Per request with a confirmation (engine kinds vllm, sglang), at its verdict: abort "
            "calls that named its ids (the first, its retries not counted, and every re-send on "
            "each abort connection), at most engines.*.abort.max_calls.",
            ["engine"], buckets=_CALL_BUCKETS, registry=registry)
        self.upstream_errors = Counter(
            "cancel_sidecar_upstream_errors_total",
            "Upstream failures, by engine and kind (ConnectError, ConnectTimeout, "
            "FirstByteTimeout, ProtocolError: malformed head, Disconnected: closed before the "
            "head, MidStream: closed or reset mid-body, ReadTimeout: silent mid-body).",
            ["engine", "kind"], registry=registry)
        self.downstream_errors = Counter(
            "cancel_sidecar_downstream_errors_total",
            "Requests refused for their body, by route prefix and kind (BodyTooLarge: over "
            "downstream.max_body_bytes, 413; BodyTimeout: silent for downstream.body_timeout_s, "
            "408). The engine never had the whole request: never aborted.",
            ["route", "kind"], registry=registry)
        self.upstream_ttfb = Histogram(
            "cancel_sidecar_upstream_time_to_first_byte_seconds",
            "Time from sending a request upstream to receiving its response headers.",
            ["engine"], buckets=_TTFB_BUCKETS, registry=registry)
        # Upgraded connections (Connection: Upgrade answered 101: a WebSocket), sidecar.tunnel.
        self.tunnels = Counter(
            "cancel_sidecar_tunnels_total",
            "Upgraded connections (a 101 relayed: WebSocket) that ended, by route prefix, who "
            "ended them (client, engine, sidecar) and how (fin, reset; the sidecar's: "
            "idle_timeout, max_bytes, deadline, shutdown). Never an abort call: the engine "
            "owns the session's ids.",
            ["route", "closed_by", "reason"], registry=registry)
        self.open_tunnels = Gauge(
            "cancel_sidecar_open_tunnels", "Upgraded connections being relayed now.",
            ["route"], registry=registry, multiprocess_mode="livesum")
        self.tunnel_bytes = Counter(
            "cancel_sidecar_tunnel_bytes_total",
            "Bytes relayed through upgraded connections after the 101, by route prefix and "
            "direction (client_to_engine, engine_to_client).",
            ["route", "direction"], registry=registry)
        self.tunnel_duration = Histogram(
            "cancel_sidecar_tunnel_duration_seconds",
            "How long upgraded connections lasted, from the 101 relayed to both sides closed.",
            ["route"], buckets=_TUNNEL_BUCKETS, registry=registry)


    def child(self, metric: _Metric, *labels: str) -> _Metric:
        """``metric.labels(*labels)``, kept: prometheus_client checks and locks on every
        ``labels`` call (1-2 us), paid per request and per abort on the hot paths. The same
        child either way (prometheus_client keeps one per label values; the sidecar never
        removes one); the labels are low-cardinality (module docstring)."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child  # type: ignore[return-value]


class ReadinessMetrics:
    """The engines' readiness as the admin listener last saw it, registered on ``registry``:
    whether each is ready, and whether its abort endpoint is usable.

    Kept apart from :class:`Metrics`: readiness is checked by the admin side (the supervisor
    under ``--workers``, whose registry otherwise only sums the workers' files), never by a
    worker, so this gauge is one process's own.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.engine_ready = Gauge(
            "cancel_sidecar_engine_ready",
            "1 if the engine passed its last readiness check (health endpoint 2xx and, for a kind "
            "that aborts, its abort endpoint usable), else 0. Checked on each GET /readyz (the "
            "kubelet's readiness probe) and by the startup check; by engine. An engine whose "
            "abort endpoint refuses counts as ready under engines.*.abort.when_unavailable "
            "close_only (see cancel_sidecar_engine_abort_unavailable).",
            ["engine"], registry=registry)
        self.engine_abort_unavailable = Gauge(
            "cancel_sidecar_engine_abort_unavailable",
            "1 if the engine's last readiness check found its health endpoint 2xx but its "
            "abort endpoint unusable (vLLM without --enable-scale-out: 403; a wrong key or "
            "path), else 0: a disconnect there only closes the upstream connection. Not ready "
            "meanwhile (cancel_sidecar_engine_ready 0) unless engines.*.abort.when_unavailable "
            "is close_only; by engine.",
            ["engine"], registry=registry)
