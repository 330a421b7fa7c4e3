"""The simulator's bookkeeping beside the scheduler objects: sessions, groups and cells (mutable,
no logic beyond their own counters)."""

from gyre.scheduler.cells import Role
from gyre.sim.config import PresetConfig
from gyre.sim.cost import Costs
from gyre.sim.kv import NONE, CellEngine, HostTier
from gyre.sim.result import CellStats

# Kinds of the events on the simulation's heap, ordered as `Simulation.run` dispatches them.
SEG_END, EXEC_END, PHASE_END, MICRO_END, OPT_END, TICK, LOSS, WAKE, START, COLLECT, FEED = range(11)


class Session:
    """One execution; it has at most one pending event (segment end or time budget), none while blocked."""

    __slots__ = (
        "group",
        "n_seg",
        "off",
        "seg",
        "deadline",
        "cell",
        "excluded",
        "gen",
        "tool",
        "eng",
        "where",
        "kv",
        "call",
        "ver",
        "marks",
        "gtok",
        "ptok",
        "kvs",
    )

    def __init__(self, group, n_seg, off, excluded, batch):
        self.group, self.n_seg, self.off, self.excluded = group, n_seg, off, excluded
        self.seg, self.deadline, self.cell = 0, 0.0, None
        self.eng, self.where, self.kv, self.call = None, NONE, 0.0, 0
        self.gen, self.tool = batch.gen_tokens, batch.tool_s
        self.ver, self.marks, self.gtok, self.ptok = -1, [], 0.0, 0.0  # marks: (version, first segment under it)
        self.kvs = 0.0  # KV token-seconds its calls held at least (grown context x unloaded decode time)


class SimGroup:
    __slots__ = ("gid", "step", "version", "remaining", "execs")

    def __init__(self, gid, step, version, size):
        self.gid, self.step, self.version, self.remaining, self.execs = gid, step, version, size, []


class SimCell:
    """The simulator's bookkeeping beside one scheduler Cell."""

    def __init__(self, cell, preset: PresetConfig, costs: Costs, ctx_tokens: float, host: HostTier):
        self.cell = cell
        self.serving = cell.role is Role.ROLLOUT
        self.members: dict = {}  # insertion-ordered set: hand-offs replay the same in every process
        self.gen_tokens = 0.0
        n = cell.num_nodes
        gen = preset.cell_gen_tok_s[cell.index] if preset.cell_gen_tok_s else preset.gen_tok_s_per_node * n
        self.eng = CellEngine(
            preset.kv_tokens_per_node * n,
            preset.max_sessions_per_node * n,
            gen,
            preset.session_tok_s,
            costs.prefill_tok_s_per_node * n,
            preset.kv_load_tok_s_per_node * n,
            host,
        )
        self.max_sessions = preset.sessions_per_node(ctx_tokens) * n
        # what the policy is told: the decode those sessions sustain at the mean context
        self.gen_tok_s = min(gen, preset.serving_tok_s_per_node(ctx_tokens) * n)
        self.train_tok_s = (
            preset.cell_train_tok_s[cell.index] if preset.cell_train_tok_s else costs.train_tok_s_per_node * n
        )
        self.slot_s = 0.0
        self.slot_t = 0.0
        self.micro = None
        self.micro_start = self.micro_end = 0.0
        self.token = 0
        self.target = None
        self.stats = CellStats(index=cell.index, is_core=cell.is_core)

    def join(self, s, now):
        self.slot_s += len(self.members) * (now - self.slot_t)
        self.slot_t = now
        self.members[s] = None

    def drop(self, s, now):
        self.slot_s += len(self.members) * (now - self.slot_t)
        self.slot_t = now
        self.members.pop(s, None)
