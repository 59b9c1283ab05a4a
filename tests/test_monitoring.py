"""The alerting rules of ``config/monitoring/`` pass ``promtool check rules`` and their unit tests
(``promtool test rules alerts_test.yaml``). The rules also run in a real Prometheus against a
real sidecar in ``tests/test_prometheus.py``, with the dashboard's queries."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.harness.prometheus_server import PROMTOOL

ROOT = Path(__file__).resolve().parent.parent
MONITORING = ROOT / "config" / "monitoring"

needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (Debian: apt-get install prometheus)")


def _promtool(*args: str) -> str:
    assert PROMTOOL is not None
    result = subprocess.run([PROMTOOL, *args], cwd=MONITORING, capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 0, (
        f"expected `promtool {' '.join(args)}` to exit 0, got {result.returncode}:\n"
        f"{result.stdout}{result.stderr}")
    return result.stdout


@needs_promtool
def test_alert_rules_pass_promtool_check() -> None:
    out = _promtool("check", "rules", "alerts.yaml")
    assert "SUCCESS: 11 rules found" in out, f"expected 11 rules, got:\n{out}"


@needs_promtool
def test_alert_rules_pass_their_unit_tests() -> None:
    out = _promtool("test", "rules", "alerts_test.yaml")
    assert "SUCCESS" in out, f"expected the rule unit tests to pass, got:\n{out}"


def test_every_alert_has_a_unit_test_and_the_docs_list_it() -> None:
    rules = yaml.safe_load((MONITORING / "alerts.yaml").read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"]}
    tests = yaml.safe_load((MONITORING / "alerts_test.yaml").read_text())
    tested = {t["alertname"] for case in tests["tests"] for t in case["alert_rule_test"]
              if t.get("exp_alerts")}
    assert tested == alerts, f"expected a firing unit test per alert {sorted(alerts)}, got " \
                             f"{sorted(tested)}"
    docs = (ROOT / "docs" / "operations.md").read_text()
    missing = [a for a in sorted(alerts) if not re.search(rf"`{a}`", docs)]
    assert not missing, f"expected docs/operations.md to list every alert, missing {missing}"
