"""Records: one per model call, the contract between the proxy and the trajectory processor."""

from gyre.records.io import ReadStats, RecordFileError, RecordWriter, read_records
from gyre.records.record import (
    FINISH_REASONS,
    KINDS,
    MAIN_AGENT,
    CallRecord,
    RecordError,
)
from gyre.records.versions import VersionSpan, WeightVersionError, make_version_spans, parse_weight_version

__all__ = [
    "CallRecord",
    "VersionSpan",
    "RecordError",
    "RecordFileError",
    "RecordWriter",
    "ReadStats",
    "read_records",
    "make_version_spans",
    "parse_weight_version",
    "WeightVersionError",
    "KINDS",
    "FINISH_REASONS",
    "MAIN_AGENT",
]
