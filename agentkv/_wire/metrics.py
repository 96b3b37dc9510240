"""A few series read out of a vLLM server's ``/metrics``, without parsing the rest.

vLLM's Prometheus exposition runs to ~70 KB, mostly histograms. ``prometheus_client``'s parser
reads all of it: ~30 ms of CPU per read on a 2-core AMD EPYC (Zen 4), against ~0.5 ms for a scan
of the lines that start with the wanted name. The SDK reads decode's KV usage before a tool wait
and the benchmark samples it twice a second, so both scan; ``tests/unit/test_wire_metrics.py``
checks the scan against ``prometheus_client``'s parser on the servers' own expositions.

>>> text = 'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\\n'
>>> sample_values(text + 'vllm:kv_cache_usage_perc{engine="1"} 0.25 1700000000\\n',
...               "vllm:kv_cache_usage_perc")
[0.5, 0.25]
"""

from __future__ import annotations

import math

__all__ = ["sample_values"]


def _value(line: str, name: str) -> float | None:
    # "<name>{labels} <value> [timestamp]" or "<name> <value> [timestamp]"; a label value may
    # hold "}" only inside quotes, so the labels end at the last "}" before the value.
    rest = line[len(name) :]
    if rest.startswith("{"):
        rest = rest[rest.rfind("}") + 1 :]
    fields = rest.split()
    if not fields:
        return None
    try:
        value = float(fields[0])
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def sample_values(text: str, name: str, *, label: str | None = None) -> list[float]:
    """The finite values of series ``name``'s samples (one per label set), in exposition order.

    Only samples named exactly ``name`` count: ``name_total`` or ``name_bucket`` are other
    series, and ``# HELP``/``# TYPE`` lines are comments. ``label`` (``'key="value"'``) keeps
    the samples whose labels hold it.

    >>> waiting = 'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 2.0\\n'
    >>> sample_values(waiting, "vllm:num_requests_waiting_by_reason", label='reason="capacity"')
    [2.0]
    """
    values: list[float] = []
    # Lines end at "\n" only (str.splitlines would also split inside a label value at "\x1e").
    for line in text.split("\n"):
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            if label is not None and label not in line[: line.rfind("}") + 1]:
                continue
            value = _value(line, name)
            if value is not None:
                values.append(value)
    return values
