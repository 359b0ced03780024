"""A node's Prometheus metrics: counters, gauges and histograms, exported in Prometheus's format.

Roles count with a small API (``inc``, ``set``, ``observe``; ``get``, ``total``, ``snapshot``
to read back) so that they never declare metric objects up front; the first use of a name
declares it with the label names of that call (plus the node's constant labels, ``node`` and
``role``). The series belong to the node, not the process: the simulator and the tests run many
nodes in one process, each with its own series.

The values are plain numbers in dicts; ``prometheus_client`` is imported only to render a scrape
(``render``, ``serve``), as families built from them at that moment. A device that serves no
metrics (no ``metrics_port``, the default) never loads it nor its HTTP server's modules (1.6 MB of
an agent's RSS), and a simulated device's series cost a dict entry, not a registry of objects.

``watch(transport)`` exports the transports' traffic counters (messages and bytes per tier and
direction) at scrape time; ``serve`` exposes everything, plus the process's CPU, memory and file
descriptors, with ``prometheus_client``'s own HTTP server. Names and labels: docs/operations.md;
each series' help text: ``DOCS``. Counters and histograms export no ``_created`` series (it doubles
the series count and nothing reads it).
"""

from __future__ import annotations

import bisect
import threading
from typing import Any, Callable, Iterable, Iterator, Sequence


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

_KINDS = ("counter", "gauge", "histogram")

_Key = tuple[str, ...]
"""A series: its label values, in the order of its metric's label names."""


class _Declared:
    """A metric's kind, the label names its calls give (sorted), all its label names, histogram bounds."""

    __slots__ = ("kind", "keys", "names", "bounds")

    def __init__(self, kind: str, keys: tuple[str, ...], names: tuple[str, ...], bounds: tuple[float, ...]) -> None:
        self.kind, self.keys, self.names, self.bounds = kind, keys, names, bounds


class Metrics:
    """The metrics of one node; thread-safe (one lock per node)."""

    def __init__(self, **const_labels: Any) -> None:
        self.const_labels = {k: str(v) for k, v in const_labels.items()}
        self._declared: dict[str, _Declared] = {}
        # counter, gauge: key -> value; histogram: key -> [count in each bucket (not cumulative) ..., sum]
        self._values: dict[str, dict[_Key, Any]] = {}
        self._lock = threading.Lock()
        self._transports: list[Any] = []
        self._process: list[Any] = []  # a registry of prometheus_client's process, platform and GC collectors
        self._included: list[Metrics] = []

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

    def _exported(self) -> list["Metrics"]:
        with self._lock:
            return [self, *self._included]

    # --- writing ------------------------------------------------------------------------------------

    def _series(self, kind: str, name: str, labels: dict[str, Any],
                buckets: Sequence[float] | None = None) -> tuple[_Declared, _Key]:
        """The metric ``name`` (declared by this first use) and the key of the labelled series; a label given
        in the call overrides a constant one. Call with the lock held."""
        keys = tuple(sorted(labels))
        found = self._declared.get(name)
        if found is None:
            names = (*[k for k in self.const_labels if k not in labels], *keys)
            bounds = tuple(sorted(float(b) for b in (buckets or SECONDS_BUCKETS)))
            found = self._declared[name] = _Declared(
                kind, keys, names, bounds if bounds[-1] == float("inf") else (*bounds, float("inf")))
            self._values[name] = {}
        if found.kind != kind:
            raise ValueError(f"metric {name} is a {found.kind}, not a {kind}")
        if found.keys != keys:
            raise ValueError(f"metric {name} has labels {list(found.keys)}, not {list(keys)}")
        return found, tuple(str(labels[n]) if n in labels else self.const_labels[n] for n in found.names)

    def inc(self, name: str, amount: float = 1.0, **labels: Any) -> None:
        """Add ``amount`` (>= 0) to a counter (its name ends in ``_total``)."""
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        with self._lock:
            _, key = self._series("counter", name, labels)
            values = self._values[name]
            values[key] = values.get(key, 0.0) + float(amount)

    def set(self, name: str, value: float, **labels: Any) -> None:
        """Set a gauge."""
        with self._lock:
            _, key = self._series("gauge", name, labels)
            self._values[name][key] = float(value)

    def observe(self, name: str, value: float, *, buckets: Sequence[float] | None = None, **labels: Any) -> None:
        """Record one observation (a duration in seconds) in a histogram."""
        value = float(value)
        with self._lock:
            declared, key = self._series("histogram", name, labels, buckets)
            counts = self._values[name].get(key)
            if counts is None:
                counts = self._values[name][key] = [0.0] * (len(declared.bounds) + 1)
            counts[bisect.bisect_left(declared.bounds, value)] += 1  # the first bound >= value, as Prometheus's
            counts[-1] += value

    def watch(self, transport: Any) -> None:
        """Export ``transport.traffic`` (a ``fedtier.transport.Traffic``) as ``MESSAGES`` and ``BYTES``."""
        with self._lock:
            if all(t is not transport for t in self._transports):
                self._transports.append(transport)

    # --- reading ------------------------------------------------------------------------------------

    def _rows(self) -> Iterator[tuple[str, dict[str, str], float]]:
        """Every sample as ``(sample name, labels, value)``: the declared series (a histogram's ``_count`` and
        ``_sum``), then the traffic of the watched transports."""
        with self._lock:
            series = [(name, d, list(self._values[name].items())) for name, d in self._declared.items()]
        for name, declared, items in series:
            for key, value in items:
                labels = dict(zip(declared.names, key, strict=True))
                if declared.kind == "histogram":
                    yield f"{name}_count", labels, float(sum(value[:-1]))
                    yield f"{name}_sum", labels, float(value[-1])
                else:
                    yield name, labels, value
        messages, nbytes = self._traffic()
        for sample, counts in ((MESSAGES, messages), (BYTES, nbytes)):
            for (tier, direction), value in sorted(counts.items()):
                yield sample, {**self.const_labels, "tier": tier, "direction": direction}, value

    def _traffic(self) -> tuple[dict[tuple[str, str], float], dict[tuple[str, str], float]]:
        """Messages and bytes per (tier, direction) of the watched transports, read now."""
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
        return messages, nbytes

    def _sample_name(self, name: str) -> str:
        declared = self._declared.get(name)
        return f"{name}_count" if declared is not None and declared.kind == "histogram" else name

    def get(self, name: str, **labels: Any) -> float:
        """A series' value; 0 if it was never touched. For a histogram, its number of observations."""
        full = {**self.const_labels, **{k: str(v) for k, v in labels.items()}}
        if name in (MESSAGES, BYTES):
            return next((float(v) for s, lab, v in self._rows() if s == name and lab == full), 0.0)
        with self._lock:
            declared = self._declared.get(name)
            if declared is None or set(declared.names) != set(full):
                return 0.0
            value = self._values[name].get(tuple(full[n] for n in declared.names))
        if value is None:
            return 0.0
        return float(sum(value[:-1])) if declared.kind == "histogram" else float(value)

    def total(self, name: str) -> float:
        """Sum of a metric over all label sets (observations, for a histogram)."""
        sample = self._sample_name(name)
        return float(sum(v for s, _, v in self._rows() if s == sample))

    def snapshot(self) -> dict[str, dict[str, float]]:
        """``{name: {"label=value,...": value}}`` without the constant labels (histograms: ``_count``, ``_sum``)."""
        out: dict[str, dict[str, float]] = {}
        for sample, labels, value in self._rows():
            key = ",".join(f"{k}={v}" for k, v in sorted(labels.items()) if k not in self.const_labels)
            out.setdefault(sample, {})[key] = value
        return out

    def _families(self) -> Iterator[Any]:
        """This node's series as ``prometheus_client`` metric families (imported here, for a scrape)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
        from prometheus_client.utils import floatToGoString

        with self._lock:
            series = [(name, d, list(self._values[name].items())) for name, d in self._declared.items()]
            process = list(self._process)
        for name, declared, items in series:
            names = list(declared.names)
            if declared.kind == "counter":
                family: Any = CounterMetricFamily(name.removesuffix("_total"), _doc(name), labels=names)
                for key, value in items:
                    family.add_metric(list(key), value)
            elif declared.kind == "gauge":
                family = GaugeMetricFamily(name, _doc(name), labels=names)
                for key, value in items:
                    family.add_metric(list(key), value)
            else:
                family = HistogramMetricFamily(name, _doc(name), labels=names)
                for key, counts in items:
                    cumulative, running = [], 0.0
                    for bound, count in zip(declared.bounds, counts[:-1], strict=True):
                        running += count
                        cumulative.append((floatToGoString(bound), running))
                    family.add_metric(list(key), cumulative, counts[-1])
            yield family
        yield from self._traffic_families()
        for collector in process:
            yield from collector.collect()

    def _traffic_families(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        messages, nbytes = self._traffic()
        names = [*self.const_labels, "tier", "direction"]
        for name, values in ((MESSAGES, messages), (BYTES, nbytes)):
            family = CounterMetricFamily(name.removesuffix("_total"), DOCS[name], labels=names)
            for (tier, direction), value in sorted(values.items()):
                family.add_metric([*self.const_labels.values(), tier, direction], value)
            yield family

    def _registry(self) -> Any:
        from prometheus_client import CollectorRegistry

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Merged(self._exported))
        return registry

    def render(self) -> str:
        """The Prometheus text exposition format, as a scrape returns it."""
        from prometheus_client.exposition import generate_latest

        return generate_latest(self._registry()).decode()

    # --- serving ------------------------------------------------------------------------------------

    def serve(self, port: int, host: str = "127.0.0.1") -> Any:
        """Serve the series (and the process's metrics) on ``host:port`` from a daemon thread.

        Returns the server (``server_address``, ``shutdown()``); port 0 lets the OS choose.
        """
        from prometheus_client import CollectorRegistry, start_http_server
        from prometheus_client.gc_collector import GCCollector
        from prometheus_client.platform_collector import PlatformCollector
        from prometheus_client.process_collector import ProcessCollector

        with self._lock:
            if not self._process:
                own = CollectorRegistry(auto_describe=False)
                ProcessCollector(registry=own)
                PlatformCollector(registry=own)
                GCCollector(registry=own)
                self._process = [own]
        server, _thread = start_http_server(port, addr=host, registry=self._registry())
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
    """The families of several nodes as one exposition: families of one name (the same series of
    different nodes) are merged, since a scrape may name each family once."""

    def __init__(self, nodes: Callable[[], list[Metrics]]) -> None:
        self.nodes = nodes

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import Metric

        merged: dict[str, Any] = {}
        for node in self.nodes():
            for family in node._families():
                found = merged.get(family.name)
                if found is None:
                    found = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                found.samples.extend(family.samples)
        return list(merged.values())


__all__ = ["BYTES", "MESSAGES", "Metrics", "SECONDS_BUCKETS", "TIERS"]
