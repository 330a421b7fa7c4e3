"""JSON for all of Gyre, in one place: orjson where it is installed (a 131K-token prompt parses
about 5x faster than with Python's json), Python's json otherwise, and for what orjson cannot do:

- writing: integers past 64 bits (a model's tool-call arguments may hold them), keys that are not
  strings (json writes them as strings), and the text another program's json writes
  (`python_text`: a chat template's `tojson`, a config file with `indent`);
- reading: NaN and Infinity, which Python's json writes and reads.

Written text is compact (no spaces after separators) and UTF-8 (nothing escaped to \\uXXXX);
numpy arrays and scalars are written as lists and numbers.
"""

import json
from collections.abc import Callable
from typing import Any

try:
    import orjson
except ImportError:  # pragma: no cover - orjson is a dependency; the fallback keeps Gyre importable
    orjson = None

DecodeError = json.JSONDecodeError
"""What `loads` raises on text that is no JSON (a ValueError; orjson's error is a subclass)."""

_COMPACT = (",", ":")


def dumpb(obj: Any, *, sort_keys: bool = False, default: Callable[[Any], Any] | None = None) -> bytes:
    """`obj` as compact JSON bytes (UTF-8).

    Raises:
        TypeError: `obj` holds a value neither JSON nor `default` can write.
    """
    if orjson is not None:
        option = orjson.OPT_SERIALIZE_NUMPY | (orjson.OPT_SORT_KEYS if sort_keys else 0)
        try:
            return orjson.dumps(obj, default=default, option=option)
        except orjson.JSONEncodeError:
            pass  # a big integer or a non-string key: json writes them
    return json.dumps(obj, sort_keys=sort_keys, default=default, separators=_COMPACT, ensure_ascii=False).encode()


def dumps(
    obj: Any,
    *,
    sort_keys: bool = False,
    default: Callable[[Any], Any] | None = None,
    python_text: bool = False,
    indent: int | None = None,
) -> str:
    """`obj` as compact JSON text; with `python_text` or `indent`, exactly the text Python's
    `json.dumps(obj, sort_keys=..., indent=...)` writes (spaces after separators, non-ASCII escaped).

    Raises:
        TypeError: `obj` holds a value neither JSON nor `default` can write.
    """
    if python_text or indent is not None:
        return json.dumps(obj, sort_keys=sort_keys, default=default, indent=indent)
    return dumpb(obj, sort_keys=sort_keys, default=default).decode()


def loads(data: str | bytes | bytearray | memoryview) -> Any:
    """The value of JSON `data`.

    Raises:
        DecodeError: `data` is no JSON.
    """
    if orjson is not None:
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            pass  # NaN or Infinity (json reads them), or no JSON: json says where it fails
    return json.loads(bytes(data) if isinstance(data, memoryview) else data)
