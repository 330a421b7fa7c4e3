"""Synthetic executions shaped like a coding-agent harness's calls, for tests and benchmarks
(test data, so the library never depends on it).

Policy tokens are drawn from [POLICY_LO, POLICY_HI) and context tokens (system prompts, user turns,
tool results, summary instructions) from [CONTEXT_LO, CONTEXT_HI), so a test can tell them apart.
"""

from dataclasses import dataclass

import numpy as np

from gyre.records.record import MAIN_AGENT, CallRecord, VersionSpan

POLICY_LO, POLICY_HI = 1_000, 60_000
CONTEXT_LO, CONTEXT_HI = 60_000, 120_000


class SyntheticExecution:
    """Makes the records of one execution; `Thread`s are the agents' linear conversations."""

    def __init__(self, execution_id: str, seed: int = 0, version: int = 0):
        self.execution_id = execution_id
        self.rng = np.random.default_rng(seed)
        self.records: list[CallRecord] = []
        self.version = version
        self.clock_s = 1_800_000_000.0

    def policy(self, n: int) -> np.ndarray:
        return self.rng.integers(POLICY_LO, POLICY_HI, n, dtype=np.int32)

    def context(self, n: int) -> np.ndarray:
        return self.rng.integers(CONTEXT_LO, CONTEXT_HI, n, dtype=np.int32)

    def call(
        self,
        agent_id: str,
        parent_agent_id: str | None,
        input_ids: np.ndarray,
        output_ids: np.ndarray,
        kind: str = "unknown",
        is_retry: bool = False,
        split_version: bool = False,
    ) -> CallRecord:
        """Record one call; split_version puts the output's second half under the next weight version."""
        n = int(output_ids.size)
        if split_version and n >= 2:
            spans = (VersionSpan(0, n // 2, self.version), VersionSpan(n // 2, n, self.version + 1))
        else:
            spans = (VersionSpan(0, n, self.version),) if n else ()
        self.clock_s += 1.0
        r = CallRecord(
            execution_id=self.execution_id,
            call_id=f"c{len(self.records)}",
            seq=len(self.records),
            agent_id=agent_id,
            parent_agent_id=parent_agent_id,
            kind_hint=kind,
            input_ids=input_ids,
            output_ids=output_ids,
            logprobs=-self.rng.exponential(0.5, n).astype(np.float32),
            version_spans=spans,
            finish_reason="stop",
            engine_id="e0",
            cell_id="cell0",
            started_at=self.clock_s,
            finished_at=self.clock_s + 0.5,
            is_retry=is_retry,
            hints={"synthetic": True},
        )
        self.records.append(r)
        return r


@dataclass
class Thread:
    """One agent's conversation: each turn sends the context and appends output + tool result."""

    ex: SyntheticExecution
    agent_id: str
    parent_agent_id: str | None
    tokens: np.ndarray

    def turn(self, n_out: int, n_tool: int, kind: str = "unknown", **call_kw) -> CallRecord:
        r = self.ex.call(self.agent_id, self.parent_agent_id, self.tokens, self.ex.policy(n_out), kind, **call_kw)
        self.tokens = np.concatenate((self.tokens, r.output_ids, self.ex.context(n_tool)))
        return r

    def summarize(self, n_instruction: int, n_out: int) -> CallRecord:
        """A compaction request: the context plus a summary instruction; the thread's context ends."""
        kind = "summary" if self.parent_agent_id is None else "subagent_summary"
        inp = np.concatenate((self.tokens, self.ex.context(n_instruction)))
        return self.ex.call(self.agent_id, self.parent_agent_id, inp, self.ex.policy(n_out), kind)

    def branch(self) -> "Thread":
        return Thread(self.ex, self.agent_id, self.parent_agent_id, self.tokens.copy())


def make_claude_like(
    execution_id: str = "bench",
    *,
    scale: float = 1.0,
    seed: int = 0,
    num_compactions: int = 3,
    num_subagents: int = 6,
    num_rewinds: int = 0,
) -> SyntheticExecution:
    """~700K unique tokens over ~430 calls at scale 1 (tokens scale linearly, call count fixed).

    Main agent: num_compactions + 1 segments of 70 turns, each but the last closed by a summary
    call; after a segment's 35th turn sub-agents of 20 turns (every other one spawns a nested
    sub-agent of 10 turns, the first compacts once); one duplicate re-send after a broken stream
    per segment; one auxiliary title call. In the last num_rewinds segments, turn 60 clears the
    tool result of turn 45 (as a harness trimming old tool output does), which abandons turns
    46..59 as a branch sharing turns 0..45 with the continuing path.
    """
    ex = SyntheticExecution(execution_id, seed)
    s = lambda n: max(1, int(n * scale))  # noqa: E731
    system, task = ex.context(s(8000)), ex.context(s(600))
    ex.call(MAIN_AGENT, None, np.concatenate((ex.context(s(300)), task)), ex.policy(12), kind="auxiliary")
    prefix = np.concatenate((system, task))
    spawned, cleared = 0, (0, 0)
    for seg in range(num_compactions + 1):
        main = Thread(ex, MAIN_AGENT, None, prefix)
        for turn in range(70):
            if turn == 20:
                broken = main.tokens
                ex.call(MAIN_AGENT, None, broken, ex.policy(s(150)))  # the stream broke; the harness re-sends
                main.turn(s(400), s(1200), is_retry=True)
                continue
            if turn == 60 and seg > num_compactions - num_rewinds:
                main.tokens = np.concatenate((main.tokens[: cleared[0]], ex.context(s(20)), main.tokens[cleared[1] :]))
            r = main.turn(s(400), s(1200), split_version=(turn == 50))
            if turn == 45:
                cleared = (r.num_tokens, main.tokens.size)  # turn 45's tool result spans [cleared)
            if turn == 35 and spawned < num_subagents:
                for _ in range(max(1, num_subagents // (num_compactions + 1))):
                    if spawned < num_subagents:
                        _run_subagent(ex, f"sa{spawned}", s, nested=spawned % 2 == 1, compact=spawned == 0)
                        spawned += 1
        if seg < num_compactions:
            summary = main.summarize(s(200), s(2000))
            prefix = np.concatenate((system, task, ex.context(s(50)), summary.output_ids))
        ex.version += 1
    while spawned < num_subagents:
        _run_subagent(ex, f"sa{spawned}", s, nested=False, compact=False)
        spawned += 1
    return ex


def _run_subagent(ex: SyntheticExecution, agent_id: str, s, nested: bool, compact: bool) -> None:
    sub = Thread(ex, agent_id, MAIN_AGENT, np.concatenate((ex.context(s(3000)), ex.context(s(300)))))
    for turn in range(20):
        sub.turn(s(400), s(1200))
        if nested and turn == 5:
            inner = Thread(ex, agent_id + ".n", agent_id, ex.context(s(2500)))
            for _ in range(10):
                inner.turn(s(300), s(900))
        if compact and turn == 12:
            summary = sub.summarize(s(200), s(800))
            sub = Thread(ex, agent_id, MAIN_AGENT, np.concatenate((ex.context(s(3300)), summary.output_ids)))
