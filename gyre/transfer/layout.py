"""Buffer layout: where each named tensor lives inside one flat byte buffer (pure, no I/O).

A sender packs tensors into a registered buffer and publishes the layout (JSON-able); the receiver
reads the whole span with one transfer and unpacks the same names. Weights and KV prefixes both
travel this way.
"""

from dataclasses import asdict, dataclass

import torch

from gyre.errors import GyreError

_ALIGN = 64
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8)
}


@dataclass(frozen=True)
class TensorSlot:
    """One tensor's place in the buffer: byte offset, dtype name, and shape."""

    name: str
    offset: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = _DTYPES[self.dtype].itemsize
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class BufferLayout:
    """An ordered set of slots; `nbytes` is the buffer size they need."""

    slots: tuple[TensorSlot, ...]
    nbytes: int

    @staticmethod
    def for_tensors(tensors: dict[str, torch.Tensor]) -> "BufferLayout":
        """Lay out `tensors` in insertion order, each slot 64-byte aligned."""
        slots, offset = [], 0
        for name, t in tensors.items():
            dtype = str(t.dtype).removeprefix("torch.")
            if dtype not in _DTYPES:
                raise GyreError(f"tensor {name!r}: dtype {dtype} not transferable; use one of {sorted(_DTYPES)}")
            slot = TensorSlot(name, offset, dtype, tuple(t.shape))
            slots.append(slot)
            offset += -(-slot.nbytes // _ALIGN) * _ALIGN
        return BufferLayout(tuple(slots), offset)

    def to_json(self) -> dict:
        return {"nbytes": self.nbytes, "slots": [asdict(s) for s in self.slots]}

    @staticmethod
    def from_json(obj: dict) -> "BufferLayout":
        slots = tuple(TensorSlot(s["name"], int(s["offset"]), s["dtype"], tuple(s["shape"])) for s in obj["slots"])
        for s in slots:
            if s.dtype not in _DTYPES:
                raise GyreError(f"slot {s.name!r}: unknown dtype {s.dtype}; valid: {sorted(_DTYPES)}")
            if s.offset < 0 or s.offset + s.nbytes > int(obj["nbytes"]):
                raise GyreError(f"slot {s.name!r} overruns the buffer ({s.offset}+{s.nbytes} > {obj['nbytes']})")
        return BufferLayout(slots, int(obj["nbytes"]))

    def pack(self, tensors: dict[str, torch.Tensor], buffer: torch.Tensor) -> None:
        """Copy `tensors` into their slots of `buffer` (a uint8 tensor of at least `nbytes`)."""
        for s in self.slots:
            self.view(buffer, s).copy_(tensors[s.name].reshape(s.shape))

    def unpack(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of `buffer` for each slot (clone them if the buffer will be reused)."""
        return {s.name: self.view(buffer, s) for s in self.slots}

    @staticmethod
    def view(buffer: torch.Tensor, slot: TensorSlot) -> torch.Tensor:
        raw = buffer[slot.offset : slot.offset + slot.nbytes]
        return raw.view(_DTYPES[slot.dtype]).view(slot.shape)
