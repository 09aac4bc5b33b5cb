"""Scraping a /metrics endpoint with a real HTTP client, and the metric names docs/metrics.md lists."""
from __future__ import annotations

import re
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from tests.support.paths import REPO


class Scrape:
    """One scrape: sample values by (sample name, labels) and the families' exposed names."""

    def __init__(self, text: str):
        self.samples: dict[tuple[str, frozenset], float] = {}
        self.names: set[str] = set()
        for family in text_string_to_metric_families(text):
            # A counter family's name drops "_total"; its samples keep it, as docs/metrics.md does.
            self.names.add(family.name + ("_total" if family.type == "counter" else ""))
            for s in family.samples:
                self.samples[(s.name, frozenset(s.labels.items()))] = s.value

    def get(self, name: str, **labels) -> float:
        """The sample's value; 0 when the series does not exist (yet)."""
        return self.samples.get((name, frozenset(labels.items())), 0.0)

    def total(self, name: str) -> float:
        """The sum over every series of `name`."""
        return sum(v for (n, _), v in self.samples.items() if n == name)


def scrape(port: int, host: str = "127.0.0.1") -> Scrape:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as reply:
        assert reply.status == 200
        assert reply.headers["Content-Type"].startswith("text/plain")
        return Scrape(reply.read().decode())


def documented_names(prefix: str) -> set[str]:
    """The names in backticks of docs/metrics.md's list that start with `prefix`."""
    text = (REPO / "docs" / "metrics.md").read_text()
    section = text.split("\n## The metrics, name by name\n", 1)[1].split("\n## ", 1)[0]
    return {n for n in re.findall(r"^\| `([a-z0-9_:]+)`", section, re.M) if n.startswith(prefix)}
