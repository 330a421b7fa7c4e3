"""The waterlevel policy and the two baselines: pure functions from an observation to role switches.

The live coordinator and the simulator build the same `Observation` (from measurements or from
the virtual clock) and apply the returned `Decision`; the policy holds no clock and does no I/O.

elastic: the core trains; satellites roll out unless the waterlevel W = queued + running fits on
    fewer rollout cells and ready training work pays for the round trip (gain >= gain_factor x
    switch costs). They return when the queue outgrows the serving cells, or when decode demand
    stayed above the serving cells' throughput for a whole window while training ran out of
    ready work (with an offload tier overload shows as slowed sessions, not as a queue; a later
    step's ready groups count only once none of its executions is live). With `critical_path`,
    executions queued for later steps (prefetch) neither keep a satellite from leaving nor pull
    it off ready training work of the current step; they call cells back once that work runs
    out. Live sessions always keep a serving cell with room for them; when none serves (the
    serving cells were lost) a satellite comes back at once, dwell or not. Three things keep it
    from thrashing: the leave rule looks at the peak waterlevel of a trailing window, a gap
    separates it from the return rule (spare capacity with headroom vs a queue of a fraction of a
    cell), and a minimum dwell time in each role.
    Switches (gyre.scheduler.config) measured alone: `leave_rule: value` (the default; `waterlevel`
    is the rule above alone) treats executions of later steps as deferrable once the current batch
    is ready; `rebalance` (a pure function the caller applies) moves live sessions onto a cell that
    returns to rollout.
async: fixed pools chosen once (`async_split`: even by default); it switches only to replace a
    rollout pool that was lost entirely.
colocate: every cell rolls out until the step's batch is ready, then every cell trains until the
    optimizer step is applied.
"""

import math
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, replace

from gyre.scheduler.cells import Role
from gyre.scheduler.config import SchedulerConfig


@dataclass(frozen=True)
class CellView:
    """What the policy needs to know about one cell."""

    index: int
    role: Role
    is_core: bool = False
    in_step: bool = False
    """Part of a training step in progress (the core may not leave it)."""
    since_s: float = 0.0
    """When its current role began, seconds on the caller's clock."""
    sessions: int = 0
    """Live sessions it serves now."""
    max_sessions: int = 1
    """Concurrent sessions its own memory can serve (configured or measured)."""
    gen_tok_s: float = 1.0
    """Generation throughput it can sustain, tokens/s (configured or measured)."""


@dataclass(frozen=True)
class Observation:
    """The cluster as the policy sees it at time `now_s`."""

    now_s: float
    cells: tuple[CellView, ...]
    queued: int = 0
    """Executions admitted but waiting for a session slot."""
    queued_ahead: int = 0
    """Of `queued`, those bound to steps after the one being trained (admitted early, as the
    staleness bound allows); the next optimizer step does not wait for them."""
    running: int = 0
    """Executions holding a slot (in a model or a tool call)."""
    running_ahead: int = 0
    """Of `running`, those bound to steps after the one being trained (prefetch already live)."""
    gen_demand_ahead_tok_s: float = 0.0
    """Of `gen_demand_tok_s`, what the executions bound to later steps draw, tokens/s."""
    pooled_sessions: int = 0
    """Sessions a cluster-wide offload tier keeps beyond the serving cells' own memory, whichever
    cells serve (sessions in tool calls hold no compute, only KV)."""
    gen_demand_tok_s: float = 0.0
    """Generation rate the live executions would draw at full per-session speed, tokens/s."""
    ready_train_s: float = 0.0
    """Ready, unclaimed training work of the current step, seconds on one satellite cell."""
    ready_ahead_train_s: float = 0.0
    """Ready training work already placed in later steps (claimable once the current step's
    optimizer step is applied), seconds on one satellite cell."""
    batch_ready: bool = False
    """Every group of the current step's batch is ready or excluded."""
    step_open: bool = False
    """The current step has claimed micro-steps and its optimizer step is not applied yet."""

    @property
    def waterlevel(self) -> int:
        return self.queued + self.running


@dataclass(frozen=True)
class Decision:
    """Cells to start switching; empty tuples mean keep every role."""

    to_train: tuple[int, ...] = ()
    to_rollout: tuple[int, ...] = ()


class BasePolicy(ABC):
    """Decides cell roles; subclasses implement `initial_roles` and `decide`."""

    def __init__(self, cfg: SchedulerConfig, num_cells: int):
        self.cfg = cfg
        self.num_cells = num_cells

    @abstractmethod
    def initial_roles(self) -> list[Role]:
        """Role of each cell (index 0 is the core) when the run starts."""

    @abstractmethod
    def decide(self, obs: Observation) -> Decision:
        """Switches to start now, given `obs`."""


def _capacity(cells: list[CellView]) -> tuple[int, float]:
    return sum(c.max_sessions for c in cells), sum(c.gen_tok_s for c in cells)


def _serves(cells: list[CellView], obs: Observation, headroom: float) -> bool:
    """Whether `cells` can serve the live work with `headroom` to spare (no work needs no cell)."""
    if obs.waterlevel == 0:
        return True
    if not cells:
        return False
    sessions, tok_s = _capacity(cells)
    need = 1.0 + headroom
    return sessions + obs.pooled_sessions >= obs.waterlevel * need and tok_s >= obs.gen_demand_tok_s * need


def _rescue(obs: Observation) -> tuple[int, ...]:
    """A training satellite to bring back when live work has no serving cell left (they were
    lost): without one no execution can progress, so neither dwell nor the queue threshold apply.
    A cell between micro-steps is taken first."""
    if not obs.waterlevel or any(c.role in (Role.ROLLOUT, Role.TO_ROLLOUT) for c in obs.cells):
        return ()
    satellites = sorted(
        (c for c in obs.cells if c.role == Role.TRAIN and not c.is_core), key=lambda c: (c.in_step, c.index)
    )
    return (satellites[0].index,) if satellites else ()


def _push_max(window: deque, entry: tuple, since: float) -> tuple:
    """Sliding-window maximum on entry[1]: add `entry`, forget entries older than `since`,
    return the window's maximum (monotonic deque, O(1) amortised)."""
    while window and window[-1][1] <= entry[1]:
        window.pop()
    window.append(entry)
    while window[0][0] < since:
        window.popleft()
    return window[0]


class ElasticPolicy(BasePolicy):
    """Gyre's waterlevel policy (see the module docstring).

    Its only memory is the trailing window of (time, waterlevel, demand) it was shown, so the same
    sequence of observations always yields the same decisions.
    """

    def __init__(self, cfg: SchedulerConfig, num_cells: int):
        super().__init__(cfg, num_cells)
        self._peak_w: deque = deque()  # (time, waterlevel, running, queued), waterlevels decreasing
        self._peak_demand: deque = deque()  # (time, demand), decreasing
        self._low_demand: deque = deque()  # (time, -demand), decreasing: the window's minimum

    def _urgent(self, obs: Observation) -> Observation:
        """`obs` without the prefetch queue when the critical path comes first."""
        if not self.cfg.critical_path or not obs.queued_ahead:
            return obs
        return replace(obs, queued=obs.queued - obs.queued_ahead, queued_ahead=0)

    def _peak(self, obs: Observation) -> Observation:
        """`obs` with the waterlevel and demand replaced by their peaks over the leave window."""
        since = obs.now_s - self.cfg.leave_window_s
        w = _push_max(self._peak_w, (obs.now_s, obs.waterlevel, obs.running, obs.queued), since)
        d = _push_max(self._peak_demand, (obs.now_s, obs.gen_demand_tok_s), since)
        return replace(obs, running=w[2], queued=w[3], gen_demand_tok_s=d[1])

    def _sustained_demand(self, obs: Observation) -> float:
        """The least decode demand over the trailing window: what a returning cell surely serves."""
        since = obs.now_s - self.cfg.leave_window_s
        return -_push_max(self._low_demand, (obs.now_s, -obs.gen_demand_tok_s), since)[1]

    def initial_roles(self) -> list[Role]:
        return [Role.TRAIN] + [Role.ROLLOUT] * (self.num_cells - 1)

    def _dwelt(self, c: CellView, now_s: float) -> bool:
        return now_s - c.since_s >= self.cfg.min_dwell_s

    def decide(self, obs: Observation) -> Decision:
        urgent = self._urgent(obs)
        peak = self._peak(urgent)
        sustained = self._sustained_demand(obs)
        back = (
            _rescue(obs)
            or self._returns(urgent, idle_only=False)
            or self._returns(obs, idle_only=True)
            or self._relieves(obs, sustained)
        )
        if back:
            return Decision(to_rollout=back)
        return Decision(to_train=self._leaves(peak))

    def _returns(self, obs: Observation, idle_only: bool) -> tuple[int, ...]:
        """Satellites to bring back because the queue outgrew the serving cells.

        With `idle_only`, only cells with no training work worth staying for come back.
        """
        serving = [c for c in obs.cells if c.role in (Role.ROLLOUT, Role.TO_ROLLOUT)]
        per_cell = max(c.max_sessions for c in obs.cells)
        if obs.queued < self.cfg.return_queue_fraction * per_cell or _serves(serving, obs, 0.0):
            return ()
        n_train = sum(c.role in (Role.TRAIN, Role.TO_TRAIN) for c in obs.cells)
        if idle_only and obs.ready_train_s / max(1, n_train) >= self.cfg.gain_factor * self.cfg.round_trip_s:
            return ()
        sessions, tok_s = _capacity(serving)
        sessions += obs.pooled_sessions
        deficit_cells = max(
            (obs.waterlevel - sessions) / per_cell,
            (obs.gen_demand_tok_s - tok_s) / max(c.gen_tok_s for c in obs.cells),
        )
        want = max(1, math.ceil(deficit_cells))
        idle = [
            c
            for c in obs.cells
            if c.role == Role.TRAIN and not c.is_core and self._dwelt(c, obs.now_s) and not (idle_only and c.in_step)
        ]
        idle.sort(key=lambda c: (c.in_step, c.index))  # cells between micro-steps first
        return tuple(c.index for c in idle[:want])

    def _relieves(self, obs: Observation, demand_tok_s: float) -> tuple[int, ...]:
        """Idle satellites to bring back because decode, not training, is the bottleneck.

        With an offload tier a queue rarely forms: an overloaded rollout shows as decode demand
        above the serving cells' throughput (every session slowed). Cells come back only when
        that overload lasted the whole trailing window (`demand_tok_s` is its minimum), training
        has too little ready work to keep its cells busy for a round trip, and the decode the cell
        adds over its minimum dwell pays for the round trip.

        Ready work of later steps is claimable only after the current step's optimizer step.
        While executions of a later step are live, it is that step's early groups only: training
        would idle through the optimizer step now and run dry again after them, waiting for the
        rest of the batch, so the idle satellite serves instead (on NL2Repo at 192 nodes the one
        serving cell is KV-bound: fewer budget hits, elastic 1.102 -> 1.094x its own bound;
        tools/bench/sim_defaults.py). Once none is live, that work is what training does next.
        """
        serving = [c for c in obs.cells if c.role in (Role.ROLLOUT, Role.TO_ROLLOUT)]
        per_cell = max(c.gen_tok_s for c in obs.cells)
        if per_cell <= 0:  # no cell's decode measured yet: nothing to weigh the demand against
            return ()
        deficit_cells = (demand_tok_s - _capacity(serving)[1]) / per_cell
        cost_s = self.cfg.gain_factor * self.cfg.round_trip_s
        n_train = sum(c.role in (Role.TRAIN, Role.TO_TRAIN) for c in obs.cells)
        later_live = obs.running_ahead + obs.queued_ahead
        backlog_s = (obs.ready_train_s + (0.0 if later_live else obs.ready_ahead_train_s)) / max(1, n_train)
        if deficit_cells <= 0 or backlog_s >= cost_s or min(1.0, deficit_cells) * self.cfg.min_dwell_s < cost_s:
            return ()
        idle = [
            c
            for c in obs.cells
            if c.role == Role.TRAIN and not c.is_core and not c.in_step and self._dwelt(c, obs.now_s)
        ]
        return tuple(c.index for c in idle[: math.ceil(deficit_cells)])

    def _leaves(self, obs: Observation) -> tuple[int, ...]:
        """Satellites to move to training: spare rollout capacity and work that pays the switch."""
        if obs.ready_train_s <= 0:
            return ()
        if self.cfg.leave_rule == "value":
            return self._leaves_by_value(obs)
        serving = [c for c in obs.cells if c.role in (Role.ROLLOUT, Role.TO_ROLLOUT)]
        n_train = sum(c.role in (Role.TRAIN, Role.TO_TRAIN) for c in obs.cells)
        candidates = [c for c in serving if c.role == Role.ROLLOUT and not c.is_core and self._dwelt(c, obs.now_s)]
        candidates.sort(key=lambda c: (c.sessions, c.index))  # cheapest hand-off first
        leaving: list[int] = []
        for c in candidates:
            rest = [s for s in serving if s.index != c.index]
            gain_s = obs.ready_train_s / (n_train + 1)
            if gain_s < self.cfg.gain_factor * self.cfg.round_trip_s or not _serves(rest, obs, self.cfg.leave_headroom):
                break
            leaving.append(c.index)
            serving = rest
            n_train += 1
        return tuple(leaving)

    def _leaves_by_value(self, obs: Observation) -> tuple[int, ...]:
        """The value-based leave rule (`leave_rule: value`): once the current step's batch is
        ready, its training is the critical path: a satellite trains when the ready work it takes
        pays for its round trip and the remaining cells still serve the current step's executions
        with headroom; executions of later steps are deferrable (slowed, their KV in the offload
        tier), though every live session keeps a place. Before that, the waterlevel rule."""
        if not obs.batch_ready:
            obs = replace(obs, queued_ahead=0, running_ahead=0, gen_demand_ahead_tok_s=0.0)
        urgent = replace(
            obs,
            queued=obs.queued - obs.queued_ahead,
            running=obs.running - obs.running_ahead,
            queued_ahead=0,
            running_ahead=0,
            gen_demand_tok_s=max(0.0, obs.gen_demand_tok_s - obs.gen_demand_ahead_tok_s),
        )
        serving = [c for c in obs.cells if c.role in (Role.ROLLOUT, Role.TO_ROLLOUT)]
        n_train = sum(c.role in (Role.TRAIN, Role.TO_TRAIN) for c in obs.cells)
        candidates = [c for c in serving if c.role == Role.ROLLOUT and not c.is_core and self._dwelt(c, obs.now_s)]
        candidates.sort(key=lambda c: (c.sessions, c.index))
        leaving: list[int] = []
        for c in candidates:
            rest = [s for s in serving if s.index != c.index]
            if obs.ready_train_s / (n_train + 1) < self.cfg.gain_factor * self.cfg.round_trip_s:
                break
            holds_all = not obs.waterlevel or (rest and _capacity(rest)[0] + obs.pooled_sessions >= obs.waterlevel)
            if not holds_all or not _serves(rest, urgent, self.cfg.leave_headroom):
                break
            leaving.append(c.index)
            serving = rest
            n_train += 1
        return tuple(leaving)


def rebalance(cells: tuple[CellView, ...], target: int) -> dict[int, int]:
    """Sessions to move from each serving cell onto cell `target`, which just returned to
    rollout, so every serving cell's load (sessions / max_sessions) is as even as whole sessions
    allow; the most loaded give first. Returns {source index: sessions to move}."""
    serving = [c for c in cells if c.role == Role.ROLLOUT]
    if not any(c.index == target for c in serving):
        return {}
    total = sum(c.sessions for c in serving)
    capacity = sum(c.max_sessions for c in serving)
    moves: dict[int, int] = {}
    want = {c.index: math.ceil(total * c.max_sessions / capacity) for c in serving}
    need = want[target] - next(c.sessions for c in serving if c.index == target)
    for c in sorted(serving, key=lambda c: (-c.sessions / c.max_sessions, c.index)):
        if need <= 0:
            break
        if c.index == target:
            continue
        give = min(need, c.sessions - want[c.index])
        if give > 0:
            moves[c.index] = give
            need -= give
    return moves


class AsyncPolicy(BasePolicy):
    """Fixed pools: the first `num_train` cells (the core first) train, the rest roll out."""

    def __init__(self, cfg: SchedulerConfig, num_cells: int, num_train: int):
        super().__init__(cfg, num_cells)
        if not 1 <= num_train < num_cells:
            raise ValueError(f"async needs 1 <= train cells < {num_cells} cells, got {num_train}")
        self.num_train = num_train

    def initial_roles(self) -> list[Role]:
        return [Role.TRAIN] * self.num_train + [Role.ROLLOUT] * (self.num_cells - self.num_train)

    def decide(self, obs: Observation) -> Decision:
        return Decision(to_rollout=_rescue(obs))


class ColocatePolicy(BasePolicy):
    """All cells roll out the batch, then all train it."""

    def initial_roles(self) -> list[Role]:
        return [Role.ROLLOUT] * self.num_cells

    def decide(self, obs: Observation) -> Decision:
        if obs.batch_ready:
            return Decision(to_train=tuple(c.index for c in obs.cells if c.role == Role.ROLLOUT))
        if not obs.step_open:
            return Decision(to_rollout=tuple(c.index for c in obs.cells if c.role == Role.TRAIN and not c.in_step))
        return Decision()


def balanced_train_cells(num_cells: int, train_share: float) -> int:
    """Training pool size for async that matches `train_share` of the cells (>= 1, < num_cells;
    an exact half rounds down, so an even split of an odd count favours rollout)."""
    return min(num_cells - 1, max(1, math.floor(num_cells * train_share + 0.5 - 1e-9)))


def make_policy(cfg: SchedulerConfig, num_cells: int, train_share: float = 0.5) -> BasePolicy:
    """The policy of `cfg.mode` for `num_cells` cells.

    Args:
        train_share: expected fraction of the work that is training; sizes async's pools when
            `cfg.async_train_cells` is 0 and `cfg.async_split` is work_share.

    Raises:
        ValueError: async with fewer than 2 cells or a pool that leaves no rollout cell.
    """
    if cfg.mode == "elastic":
        return ElasticPolicy(cfg, num_cells)
    if cfg.mode == "colocate":
        return ColocatePolicy(cfg, num_cells)
    share = train_share if cfg.async_split == "work_share" else 0.5
    num_train = cfg.async_train_cells or balanced_train_cells(num_cells, share)
    return AsyncPolicy(cfg, num_cells, num_train)
