"""Each execution's recent conversations as the proxy last saw them, so a call costs what it adds (pure).

A harness re-sends its whole conversation on every call. The proxy keeps, per execution, the last
few requests' message lists as they came off the wire (a `RequestSnapshot`: the parsed JSON, its
conversion to template messages, and its rendered prompt with checkpoints), and a new call first
finds the snapshot sharing the longest run of leading messages with it (same head: system prompt
and tools). Where the new body's bytes start with the snapshot's up to the end of its last message
(a harness re-serialising the same history), that decides with one memcmp; otherwise comparing
parsed JSON is a C-level walk over equal objects (strings compare by memcmp). Both are much cheaper
than converting, rendering or tokenizing the messages again; only the messages after the
shared run are converted (`gyre.proxy.chat.convert_messages`) and rendered
(`gyre.proxy.render.Renderer.render`, from a checkpoint). A call whose messages and other fields
equal its snapshot's (`stream` aside) is a harness re-sending it: a retry.
"""

from dataclasses import dataclass

from gyre.proxy.chat import ChatRequest
from gyre.proxy.render import RenderResult


@dataclass(frozen=True)
class WireRequest:
    """A request body split the way matching needs it (per wire: which fields are the head)."""

    head: tuple
    """The fields every call of a conversation repeats before its messages (system, tools)."""
    messages: list
    """The wire's message list, as parsed."""
    rest: dict
    """Every other field except `stream` (a retry repeats them)."""
    raw: bytes = b""
    """The body as it came (b"" where unknown)."""
    messages_end: int = -1
    """Where the message list's last item ends in `raw` (-1: not known; see `gyre.proxy.wire.split_request`)."""


@dataclass(frozen=True, eq=False)
class RequestSnapshot:
    request: WireRequest
    chat: ChatRequest
    rendered: RenderResult


def num_shared(a: list, b: list) -> int:
    """How many leading items `a` and `b` share (identity first: the same parsed object is equal).

    A continuing call shares all of the shorter list: one list comparison (a loop in C) says so;
    only a call that changed an earlier message is walked item by item."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i] is b[i] or a[i] == b[i]:
        i += 1
    return i


def num_shared_messages(old: WireRequest, new: WireRequest) -> int:
    """How many leading messages `new` shares with `old`: all of `old`'s where `new`'s body starts
    with `old`'s up to the end of its last message and goes on with "," or "]" (equal bytes parse
    alike: one memcmp, ~5x cheaper than walking the parsed messages of a 4 MB body); else `num_shared`.
    The last shared message is compared too: a later duplicate message key would replace the list."""
    n, end = len(old.messages), old.messages_end
    if (
        end > 0
        and new.raw[end : end + 1] in (b",", b"]")
        and new.raw.startswith(memoryview(old.raw)[:end])
        and len(new.messages) >= n
        and new.messages[n - 1] == old.messages[n - 1]
    ):
        return n
    return num_shared(old.messages, new.messages)


class ConversationCache:
    """The last `max_snapshots` conversations of one execution (most recent first)."""

    def __init__(self, max_snapshots: int = 4):
        self.max_snapshots = max_snapshots
        self._snapshots: list[RequestSnapshot] = []

    def match(self, request: WireRequest) -> tuple[RequestSnapshot | None, int]:
        """The snapshot with the same head sharing the most leading messages, and how many."""
        best, best_n = None, 0
        for snap in self._snapshots:
            if snap.request.head != request.head:
                continue
            n = num_shared_messages(snap.request, request)
            if n > best_n:
                best, best_n = snap, n
        return best, best_n

    @staticmethod
    def is_retry(snap: RequestSnapshot | None, num: int, request: WireRequest) -> bool:
        """Whether `request` repeats `snap` (as matched, sharing `num` messages) but for `stream`."""
        return (
            snap is not None
            and num == len(request.messages) == len(snap.request.messages)
            and snap.request.rest == request.rest
        )

    def store(self, snap: RequestSnapshot, replaces: RequestSnapshot | None) -> None:
        """Keep `snap` first; `replaces` (the snapshot it continues, if any) goes."""
        self._snapshots = [snap] + [s for s in self._snapshots if s is not replaces][: self.max_snapshots - 1]

    def clear(self) -> None:
        self._snapshots = []
