"""fedtier.runtime.metrics: counters, gauges and the Prometheus text exposition format."""

from __future__ import annotations

import re
import threading
import urllib.error
import urllib.request
from typing import Iterator

import pytest

from fedtier.runtime.metrics import Metrics

# Prometheus text format 0.0.4: a sample line is ``name{label="value",...} number``.
_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\\\|\\"|\\n)*"'
_SAMPLE = re.compile(rf"^({_NAME})(\{{(?:{_LABEL}(?:,{_LABEL})*)?\}})? (\S+)$")
_TYPE = re.compile(rf"^# TYPE ({_NAME}) (counter|gauge|histogram|summary|untyped)$")


def parse_exposition(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A strict little parser: every line must be a TYPE line or a sample of a declared
    metric; returns {(name, sorted labels): value}."""
    assert text.endswith("\n")
    declared: dict[str, str] = {}
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            m = _TYPE.match(line)
            assert m, f"bad comment line {line!r}"
            assert m.group(1) not in declared, f"TYPE declared twice: {line!r}"
            declared[m.group(1)] = m.group(2)
            continue
        m = _SAMPLE.match(line)
        assert m, f"bad sample line {line!r}"
        name = m.group(1)
        assert name in declared, f"sample before its TYPE line: {line!r}"
        labels = tuple(sorted(
            (k, v.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\"))
            for k, v in re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(2) or "")))
        samples[(name, labels)] = float(m.group(3))
    return samples


def test_inc_set_get_total() -> None:
    m = Metrics()

    m.inc("fedtier_rejected_total", reason="sha_mismatch")
    m.inc("fedtier_rejected_total", reason="sha_mismatch")
    m.inc("fedtier_rejected_total", 3, reason="truncated")
    m.set("fedtier_round", 4)
    m.set("fedtier_round", 5)

    assert m.get("fedtier_rejected_total", reason="sha_mismatch") == 2.0
    assert m.get("fedtier_rejected_total", reason="truncated") == 3.0
    assert m.get("fedtier_rejected_total") == 0.0  # the unlabelled series does not exist
    assert m.get("never_touched", reason="x") == 0.0
    assert m.total("fedtier_rejected_total") == 5.0
    assert m.total("never_touched") == 0.0
    assert m.get("fedtier_round") == 5.0


def test_label_order_does_not_matter_and_values_are_stringified() -> None:
    m = Metrics()

    m.inc("x_total", a=1, b="two")
    m.inc("x_total", b="two", a="1")

    assert m.get("x_total", a="1", b="two") == 2.0


def test_snapshot() -> None:
    m = Metrics()
    m.inc("x_total", reason="a")
    m.set("g", 2.5)

    assert m.snapshot() == {"x_total": {"reason=a": 1.0}, "g": {"": 2.5}}


def test_render_by_hand() -> None:
    m = Metrics(node="edge-1")
    m.inc("fedtier_rejected_total", reason="sha_mismatch")
    m.set("fedtier_round", 3)

    assert m.render() == (
        "# TYPE fedtier_rejected_total counter\n"
        'fedtier_rejected_total{node="edge-1",reason="sha_mismatch"} 1\n'
        "# TYPE fedtier_round gauge\n"
        'fedtier_round{node="edge-1"} 3\n'
    )


def test_render_without_labels() -> None:
    m = Metrics()
    m.set("up", 1)

    assert m.render() == "# TYPE up gauge\nup 1\n"


def test_render_is_valid_exposition_text_with_escaped_labels() -> None:
    # Prepare: label values with every character the format escapes.
    m = Metrics(node="edge-1")
    nasty = 'a "quoted" back\\slash\nnewline'
    m.inc("fedtier_rejected_total", reason=nasty)
    m.inc("fedtier_rejected_total", reason="plain")
    m.set("fedtier_pending_bytes", 0.5, cell="c1")

    # Execute
    text = m.render()

    # Assert
    assert '\\"quoted\\"' in text and "back\\\\slash" in text and "\\nnewline" in text
    samples = parse_exposition(text)
    assert samples == {
        ("fedtier_rejected_total", (("node", "edge-1"), ("reason", nasty))): 1.0,
        ("fedtier_rejected_total", (("node", "edge-1"), ("reason", "plain"))): 1.0,
        ("fedtier_pending_bytes", (("cell", "c1"), ("node", "edge-1"))): 0.5,
    }


@pytest.mark.parametrize("value", [1234567, 2**31 + 3, 98765432.0, 0.1234567])
def test_render_keeps_full_precision(value: float) -> None:
    """Byte counters pass a million quickly. ``{value:g}`` keeps six significant digits,
    so 1234567 is rendered as ``1.23457e+06`` and Prometheus scrapes 1234570."""
    m = Metrics()
    m.inc("fedtier_bytes_total", value)

    samples = parse_exposition(m.render())

    assert samples[("fedtier_bytes_total", ())] == float(value)


def test_concurrent_increments_are_not_lost() -> None:
    m = Metrics()

    def work() -> None:
        for _ in range(2000):
            m.inc("x_total", k="v")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()

    assert m.get("x_total", k="v") == 8000.0


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Metrics, str]]:
    """One server for the module: ``shutdown`` waits out serve_forever's 0.5 s poll."""
    m = Metrics(node="edge-1")
    server = m.serve(0)  # port 0: the OS picks a free port
    host, port = server.server_address[:2]
    try:
        yield m, f"http://{host}:{port}"
    finally:
        server.shutdown()
        server.server_close()


def test_serve_metrics_over_http(served: tuple[Metrics, str]) -> None:
    m, base = served
    m.inc("fedtier_rejected_total", reason="truncated")

    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as resp:
        body = resp.read().decode()
        status, ctype = resp.status, resp.headers["Content-Type"]

    assert status == 200
    assert ctype.startswith("text/plain")
    assert "version=0.0.4" in ctype
    assert body == m.render()
    assert parse_exposition(body)[("fedtier_rejected_total", (("node", "edge-1"), ("reason", "truncated")))] == 1.0


def test_serve_reflects_later_updates(served: tuple[Metrics, str]) -> None:
    m, base = served
    m.set("g", 1)
    urllib.request.urlopen(f"{base}/metrics", timeout=5).close()
    m.set("g", 2)

    with urllib.request.urlopen(f"{base}/metrics/", timeout=5) as resp:
        body = resp.read().decode()

    assert parse_exposition(body)[("g", (("node", "edge-1"),))] == 2.0


@pytest.mark.parametrize("path", ["/", "/metric", "/metrics/x", "/favicon.ico"])
def test_serve_404_for_other_paths(served: tuple[Metrics, str], path: str) -> None:
    _, base = served

    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"{base}{path}", timeout=5)
    info.value.close()

    assert info.value.code == 404
