"""Benchmarking and auto-tuning: seeded workloads driven through the public LLM API, reports
(JSON, Markdown, a terminal table, plots) and a tuner for runtime and build knobs.

Every latency number comes from llmc.runtime.metrics, the one place the metrics are defined.
"""
