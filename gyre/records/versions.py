"""Weight versions: the one parser of a version on the wire and the one span type over output tokens.

The engine wire (`meta_info.weight_version_spans`), the records (`CallRecord.version_spans`) and
batching (the staleness mask) all describe "which optimizer step's weights produced these output
tokens" with `VersionSpan`s made by `make_version_spans`, and read a version with
`parse_weight_version`, so they can never disagree on what a span or a bad version is.
"""

from dataclasses import dataclass

import numpy as np

from gyre.errors import GyreError


class WeightVersionError(GyreError, ValueError):
    """A weight version that is not an integer >= 0 (nor its decimal string)."""


def parse_weight_version(value: object) -> int:
    """A weight version as Gyre's integer (the optimizer step): an int >= 0 or its decimal string
    (SGLang's API declares it a string; Gyre launches SGLang with `--weight-version 0`).

    Raises:
        WeightVersionError: anything else, naming the value.
    """
    if isinstance(value, str) and value.isdecimal():
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise WeightVersionError(f"weight_version must be an integer >= 0 (the trainer's step), got {value!r}")


@dataclass(frozen=True)
class VersionSpan:
    """Output tokens [start, end) were sampled under weights of optimizer step `version`."""

    start: int
    end: int
    version: int

    def to_wire(self) -> dict:
        """As `meta_info.weight_version_spans` carries it."""
        return {"weight_version": self.version, "start": self.start, "end": self.end}

    @staticmethod
    def from_wire(obj: dict) -> "VersionSpan":
        """Raises: WeightVersionError, KeyError, ValueError on a malformed span."""
        return VersionSpan(int(obj["start"]), int(obj["end"]), parse_weight_version(obj["weight_version"]))


def make_version_spans(versions) -> tuple[VersionSpan, ...]:
    """Runs of equal weight versions, one entry per output token, as VersionSpans."""
    v = np.asarray(versions, dtype=np.int64)
    if v.size == 0:
        return ()
    starts = np.concatenate(([0], np.flatnonzero(v[1:] != v[:-1]) + 1))
    ends = np.concatenate((starts[1:], [v.size]))
    return tuple(VersionSpan(int(a), int(b), int(v[a])) for a, b in zip(starts, ends))


def versions_between(spans: list[VersionSpan], start: int, end: int) -> list[int]:
    """The version of each output position in [start, end), from the spans that overlap it."""
    return [s.version for s in spans for _ in range(max(s.start, start), min(s.end, end))]
