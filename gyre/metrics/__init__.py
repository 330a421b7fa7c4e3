"""Observability: typed events every process emits to the run's events.jsonl, and the views built from it.

events.py (the contract) -> log.py (EventLog: one O_APPEND line per event; read_events) ->
state.py (RunState: a pure fold of events) -> sinks.py (TensorBoard, W&B), progress.py (live
progress), plots.py (PNGs), report.py (`gyre-report` and the final summary). monitor.py wires the
views for the coordinator: it follows events.jsonl, so events from other processes count too.
"""
