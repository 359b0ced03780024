"""A node's Prometheus metrics: counters, gauges and histograms on its own ``CollectorRegistry``.

Roles count with a small API (``inc``, ``set``, ``observe``; ``get``, ``total``, ``snapshot``
to read back) so that they never declare metric objects up front; the first use of a name
declares it in the node's registry with the label names of that call (plus the node's
constant labels, ``node`` and ``role``). The registry belongs to the node, not the process:
the simulator and the tests run many nodes in one process, each with its own series.

``watch(transport)`` exports the transports' traffic counters (messages and bytes per tier and
direction) at scrape time; ``serve`` exposes everything, plus the process's CPU, memory and file
descriptors, with ``prometheus_client``'s own HTTP server. Names and labels: docs/operations.md;
each series' help text: ``DOCS``. Counters and histograms export no ``_created`` series (it doubles
the series count and nothing reads it): ``disable_created_metrics`` at import, for the process.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, start_http_server
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector


MESSAGES = "fedtier_messages_total"
"""Messages sent (``direction="out"``) and received (``"in"``) per ``tier``; chunks count one each."""
BYTES = "fedtier_bytes_total"
"""Bytes on the wire, like ``MESSAGES``."""

TIERS = {
    "cell_up": "device_edge", "cell_down": "device_edge", "cell_manifest": "device_edge",
    "edge_up": "edge_cloud", "cloud_down": "edge_cloud", "manifest": "edge_cloud",
    "status": "presence",
}
"""The tier of each topic channel (``fedtier.transport.topics``): the device<->edge hop, the
edge<->cloud hop, and presence (retained status documents)."""

SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, float("inf"))
"""Histogram buckets for round-scale durations: a simulated round takes tens of milliseconds,
a fleet's round minutes."""

_KINDS = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}

disable_created_metrics()


class Metrics:
    """The metrics of one node; thread-safe (``prometheus_client`` locks each series)."""

    def __init__(self, **const_labels: Any) -> None:
        self.const_labels = {k: str(v) for k, v in const_labels.items()}
        self.registry = CollectorRegistry(auto_describe=True)
        self._declared: dict[str, tuple[str, tuple[str, ...], Any]] = {}
        self._lock = threading.Lock()
        self._traffic = _TrafficCollector(self.const_labels)
        self.registry.register(self._traffic)
        self._process_collectors = False
        self._included: list[Metrics] = []
        self.exposed = CollectorRegistry(auto_describe=False)
        """What a scrape returns: this node's series and those of every ``include``d one, merged by name."""
        self.exposed.register(_Merged(self._registries))

    def include(self, other: "Metrics") -> None:
        """Export ``other``'s series with this node's (a service hosting nodes: one scrape for all of them;
        their constant labels tell them apart)."""
        with self._lock:
            if all(m is not other for m in self._included):
                self._included.append(other)

    def exclude(self, other: "Metrics") -> None:
        """Stop exporting ``other``'s series (a hosted node is gone)."""
        with self._lock:
            self._included = [m for m in self._included if m is not other]

    def _registries(self) -> list[CollectorRegistry]:
        with self._lock:
            return [self.registry, *(m.registry for m in self._included)]

    # --- writing ------------------------------------------------------------------------------------

    def _series(self, kind: str, name: str, labels: dict[str, Any], buckets: Sequence[float] | None = None) -> Any:
        """The labelled child of ``name``; a label given in the call overrides a constant one."""
        values = {**self.const_labels, **{k: str(v) for k, v in labels.items()}}
        keys = tuple(sorted(labels))
        with self._lock:
            found = self._declared.get(name)
            if found is None:
                extra: dict[str, Any] = {"buckets": tuple(buckets or SECONDS_BUCKETS)} if kind == "histogram" else {}
                names = (*[k for k in self.const_labels if k not in labels], *keys)
                metric = _KINDS[kind](name, _doc(name), labelnames=names, registry=self.registry, **extra)
                found = self._declared[name] = (kind, keys, metric)
        declared_kind, declared_keys, metric = found
        if declared_kind != kind:
            raise ValueError(f"metric {name} is a {declared_kind}, not a {kind}")
        if declared_keys != keys:
            raise ValueError(f"metric {name} has labels {list(declared_keys)}, not {list(keys)}")
        return metric.labels(**values) if values else metric

    def inc(self, name: str, amount: float = 1.0, **labels: Any) -> None:
        """Add ``amount`` (>= 0) to a counter (its name ends in ``_total``)."""
        self._series("counter", name, labels).inc(amount)

    def set(self, name: str, value: float, **labels: Any) -> None:
        """Set a gauge."""
        self._series("gauge", name, labels).set(float(value))

    def observe(self, name: str, value: float, *, buckets: Sequence[float] | None = None, **labels: Any) -> None:
        """Record one observation (a duration in seconds) in a histogram."""
        self._series("histogram", name, labels, buckets).observe(float(value))

    def watch(self, transport: Any) -> None:
        """Export ``transport.traffic`` (a ``fedtier.transport.Traffic``) as ``MESSAGES`` and ``BYTES``."""
        self._traffic.add(transport)

    # --- reading ------------------------------------------------------------------------------------

    def _sample_name(self, name: str) -> str:
        kind = self._declared.get(name, ("counter",))[0]
        return f"{name}_count" if kind == "histogram" else name

    def get(self, name: str, **labels: Any) -> float:
        """A series' value; 0 if it was never touched. For a histogram, its number of observations."""
        full = {**self.const_labels, **{k: str(v) for k, v in labels.items()}}
        value = self.registry.get_sample_value(self._sample_name(name), full)
        return 0.0 if value is None else float(value)

    def total(self, name: str) -> float:
        """Sum of a metric over all label sets (observations, for a histogram)."""
        sample = self._sample_name(name)
        return float(sum(s.value for s in self._samples() if s.name == sample))

    def snapshot(self) -> dict[str, dict[str, float]]:
        """``{name: {"label=value,...": value}}`` without the constant labels (histograms: ``_count``, ``_sum``)."""
        out: dict[str, dict[str, float]] = {}
        wanted = {n for n, (kind, _, _) in self._declared.items() if kind != "histogram"}
        wanted |= {f"{n}{s}" for n, (kind, _, _) in self._declared.items() if kind == "histogram"
                   for s in ("_count", "_sum")}
        wanted |= {MESSAGES, BYTES}
        for s in self._samples():
            if s.name in wanted:
                key = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in self.const_labels)
                out.setdefault(s.name, {})[key] = s.value
        return out

    def _samples(self) -> Iterator[Any]:
        for family in self.registry.collect():
            yield from family.samples

    def render(self) -> str:
        """The Prometheus text exposition format, as a scrape returns it."""
        return generate_latest(self.exposed).decode()

    # --- serving ------------------------------------------------------------------------------------

    def serve(self, port: int, host: str = "127.0.0.1") -> Any:
        """Serve the registry (and the process's metrics) on ``host:port`` from a daemon thread.

        Returns the server (``server_address``, ``shutdown()``); port 0 lets the OS choose.
        """
        with self._lock:
            if not self._process_collectors:
                ProcessCollector(registry=self.registry)
                PlatformCollector(registry=self.registry)
                GCCollector(registry=self.registry)
                self._process_collectors = True
        server, _thread = start_http_server(port, addr=host, registry=self.exposed)
        return server


def _doc(name: str) -> str:
    return DOCS.get(name, name.replace("_", " "))


DOCS = {
    # every node (fedtier.runtime.node_base; the traffic is read from the transports at scrape time)
    MESSAGES: "MQTT messages (chunks) sent and received, per tier and direction.",
    BYTES: "MQTT payload bytes sent and received, per tier and direction.",
    "fedtier_rejected_total": "Messages rejected as bad input, by the typed error's reason.",
    "fedtier_dropped_total": "Messages ignored without being an error (duplicate, superseded, not selected), "
                             "by reason.",
    "fedtier_accepted_total": "Messages accepted by the node's role, by message kind.",
    "fedtier_stragglers_total": "Messages for a round the node had already closed (also rejected as late).",
    "fedtier_identity_conflicts_total": "Times the presence of a child of this node showed two clients taking "
                                        "turns under one identity (a copied bundle), by that identity.",
    # the coordinator (cloud_coordinator.observe.prom, cloud_coordinator.node)
    "fedtier_round": "The last closed round (0-based).",
    "fedtier_accuracy": "Central test accuracy (fraction correct) after the last closed round.",
    "fedtier_loss": "Central test loss (mean per example) after the last closed round.",
    "fedtier_federated_accuracy": "The devices' accuracy on their held-out rows of the model the last round "
                                  "started from (federated evaluation).",
    "fedtier_federated_accuracy_min": "The lowest accuracy of one device on its own held-out rows of the model the "
                                      "last round started from (the worst device of federated evaluation).",
    "fedtier_auroc": "Central test AUROC after the last closed round (binary tasks).",
    "fedtier_round_seconds": "Round latency in seconds: from the previous round's close (or the start) to this "
                             "round's close.",
    "fedtier_devices_known": "Devices of the cell in the rollout's topology.",
    "fedtier_devices_online": "Devices of the cell whose presence is online (their own, or their edge's summary "
                              "where it does not reach the coordinator).",
    "fedtier_devices_reporting": "Devices of the cell whose updates made it into the last closed round.",
    "fedtier_dropouts_total": "Devices of the cell missing from a closed round, summed over rounds.",
    "fedtier_quorum_misses_total": "Rounds that closed without the cell (its deadline passed and a quorum of "
                                   "the other cells closed the round).",
    "fedtier_model_version": "The model version the cell's next task carries.",
    "fedtier_epsilon_spent": "The largest differential-privacy epsilon spent by a device of the cell (ledger).",
    "fedtier_epsilon_spent_max": "The largest differential-privacy epsilon spent by any device (ledger).",
    "fedtier_epsilon_budget": "The rollout's differential-privacy epsilon budget per device.",
    "fedtier_quorum": "The share of a cell's devices (and of the cells) enough to close a round after its "
                      "deadline.",
    "fedtier_round_deadline_timestamp_seconds": "Unix time the open round's deadline passes (+Inf while no "
                                                "round is open: between rounds, paused or ended).",
    # an edge (edge_broker.service)
    "fedtier_edge_aggregation_seconds": "Seconds from a round's cell task arriving at the edge to the cell's "
                                        "update leaving for the cloud.",
    "fedtier_secagg_aborts_total": "Secure-aggregation rounds of the cell the edge aborted, by reason.",
    "fedtier_secagg_waited_total": "Devices a secure-aggregation phase of the cell closed without at its own "
                                   "deadline, by phase.",
    # an edge (its devices' reports) and a device (its own: device_agent.node)
    "fedtier_training_failed_total": "Local work devices could not compute and reported as training_failed "
                                     "(crash, error, non_finite), by reason.",
}
"""Help text of every series a fedtier node exports (docs/operations.md lists them with their labels)."""


class _Merged:
    """The families of several registries as one exposition: families of one name (the same series of
    different nodes) are merged, since a scrape may name each family once."""

    def __init__(self, registries: Callable[[], list[CollectorRegistry]]) -> None:
        self.registries = registries

    def collect(self) -> Iterable[Metric]:
        merged: dict[str, Metric] = {}
        for registry in self.registries():
            for family in registry.collect():
                found = merged.get(family.name)
                if found is None:
                    found = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                found.samples.extend(family.samples)
        return list(merged.values())


class _TrafficCollector:
    """Reads the transports' ``Traffic`` at scrape time (no second count to keep in step)."""

    def __init__(self, const_labels: dict[str, str]) -> None:
        self.const_labels = const_labels
        self._transports: list[Any] = []
        self._lock = threading.Lock()

    def add(self, transport: Any) -> None:
        with self._lock:
            if all(t is not transport for t in self._transports):
                self._transports.append(transport)

    def describe(self) -> Iterable[Metric]:
        return list(self._families({}, {}))

    def collect(self) -> Iterable[Metric]:
        messages: dict[tuple[str, str], float] = {}
        nbytes: dict[tuple[str, str], float] = {}
        with self._lock:
            transports = list(self._transports)
        for t in transports:
            traffic = t.traffic
            with traffic._lock:
                counts = [(k, traffic.messages.get(k, 0), n) for k, n in traffic.bytes.items()]
            for (direction, channel), n_messages, n_bytes in counts:
                key = (TIERS.get(channel, "other"), direction)
                messages[key] = messages.get(key, 0) + n_messages
                nbytes[key] = nbytes.get(key, 0) + n_bytes
        return list(self._families(messages, nbytes))

    def _families(self, messages: dict[tuple[str, str], float], nbytes: dict[tuple[str, str], float]
                  ) -> Iterator[Metric]:
        names = [*self.const_labels, "tier", "direction"]
        for name, help_text, values in ((MESSAGES, DOCS[MESSAGES], messages), (BYTES, DOCS[BYTES], nbytes)):
            family = CounterMetricFamily(name.removesuffix("_total"), help_text, labels=names)
            for (tier, direction), value in sorted(values.items()):
                family.add_metric([*self.const_labels.values(), tier, direction], value)
            yield family


__all__ = ["BYTES", "MESSAGES", "Metrics", "SECONDS_BUCKETS", "TIERS"]
