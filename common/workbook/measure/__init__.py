"""Measuring the ops: what the demo, the notebooks and `make bench` time with.

    timing      timing primitives: medians, IQR, interleaved rounds, the machine's load, verdicts
    harness     the benchmark harness: plans, validation against float64, timing, memory,
                targets, reports (JSON, Markdown, plot); each op's part is ops/<op>/bench.py
"""
