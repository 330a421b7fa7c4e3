"""The ranks of one cell: its first rank drives, the others run the same trainer calls in lockstep.

    rank 0 (the cell's leader, its control endpoint)        ranks 1..n-1 (`follow`)
    CellRanks.run(op, *args)  ──broadcast (op, args)──────>  op(state, *args)
    op(state, *args)          <──── collectives of op ────>  (TP all-gathers, DP gradient broadcasts)
    keepalive: ("ping",) when idle KEEPALIVE_S               a follower that exits: `on_lost` on rank 0
    link: heartbeats both ways, closure seen <──── TCP ────  heartbeats both ways (rank_hang_timeout_s / 4)

    python -m gyre.train.ranks --config FILE   (a follower; FILE: {model, trainer, seed}; RANK etc. set)

A cell's trainer ranks form one torch.distributed group with megatron-core's tensor- and
data-parallel groups (gyre/train/model.py); every collective must be entered by every rank in the
same order, so rank 0 announces each operation that contains one before entering it. A cell's
layouts are tensor parallel (`trainer.tensor_parallel_size`) and data parallel (the remaining
ranks). Pipeline parallel is not built: the trainer builds its model and step without
megatron-core's pipeline schedules. On CPU those schedules (megatron-core 0.16.1) fail at a counter
allocated on the literal device "cuda", which the CPU shim cannot redirect; with that one allocation
on the CPU, the 1F1B schedule over 2 gloo stages gives the unpipelined model's loss and gradients
bit for bit (`tools/probe/pp_cpu.py [--patch]`), so CPU is no obstacle to building it.

A dead or hung rank is found by processes, not by collectives (whose timeout,
`trainer.collective_timeout_s`, a long micro-step must not hit): rank 0 watches its followers and
calls `on_lost` when one exits or falls silent (the leader then exits: the cell is lost). Spawned
followers are rank 0's children: it polls them, and they die with it (PR_SET_PDEATHSIG). Followers
that srun placed (on other nodes) are nobody's children, so each opens a TCP link to rank 0 once
the group is up (`link_host`): the kernel closes it when either process dies, SIGKILL included,
and TCP keepalive ends it when a node goes away, so either side learns of the other's death within
a poll, not at the next collective. A stopped (SIGSTOP) or hung follower is not dead and its
kernel still answers TCP: every follower, children too, sends a heartbeat on its link from a thread
of its own, and one silent for `trainer.rank_hang_timeout_s` is lost like a dead one; rank 0 beats
back, and a follower that stops hearing it exits (a stopped leader is the coordinator's to find,
by its control channel's heartbeats). A follower waits for the next announcement inside a
collective, so rank 0 pings an idle cell well within that timeout. On Slurm a
follower that is its node's first rank serves its node's engines too: it starts them, `engine_urls`
hands their URLs to rank 0, and their exit ends the follower (gyre.cells.slurm).
"""

import argparse
import dataclasses
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import NoReturn, TypeVar

import torch.distributed as dist

from gyre.common.files import read_child_config, write_child_config
from gyre.common.run_paths import RunPaths
from gyre.common.serve import exit_at_once
from gyre.common.spawn import spawn_child
from gyre.models.checkpoint import load_checkpoint
from gyre.models.config import ModelConfig
from gyre.train.checkpoint import CheckpointManager
from gyre.train.config import TrainerConfig
from gyre.train.model import use_device
from gyre.train.shard import SHARD_OPS, RankState
from gyre.train.trainer import Trainer

T = TypeVar("T")


def save(state: RankState, root: str, keep_last: int, extra: dict | None) -> str:
    return str(CheckpointManager(root, keep_last).save(state.trainer, extra))


def load_latest(state: RankState, root: str, keep_last: int) -> dict | None:
    return CheckpointManager(root, keep_last).load_latest(state.trainer)


def load_engine_dir(state: RankState, path: str) -> None:
    state.trainer.load_engine_weights(load_checkpoint(path)[1])


def ping(state: RankState) -> None:
    """Nothing: keeps an idle follower's wait for the next announcement short of the group's timeout."""


def link(state: RankState, host: str, port: int, silence_s: float = 0.0) -> None:
    """A follower opens its link to rank 0 (`CellRanks`, which accepts instead) and exits if rank 0
    dies (the link closes without rank 0's goodbye); with `silence_s`, the two send each other a
    heartbeat four times a period, each from a thread of its own, and a follower that hears none
    from rank 0 for `silence_s` (stopped or hung) exits too."""
    if dist.get_rank() == 0:
        return
    state.link = socket.create_connection((host, port), timeout=LINK_TIMEOUT_S)
    state.link.sendall(f"{dist.get_rank()}\n".encode())
    state.link.settimeout(None)
    threading.Thread(target=_exit_with_rank0, args=(state.link, silence_s), daemon=True, name="rank0-link").start()
    if silence_s:
        threading.Thread(target=_beat, args=(state.link, silence_s / 4), daemon=True, name="rank0-beat").start()


def _beat(link: socket.socket, every_s: float) -> None:
    try:
        while True:
            link.sendall(b"h")
            time.sleep(every_s)
    except OSError:
        return  # the link is gone: _exit_with_rank0 decides what that means


def _exit_with_rank0(link: socket.socket, silence_s: float) -> None:
    """Read rank 0's heartbeats until its goodbye; its link closing or falling silent ends this rank."""
    try:
        got = link.recv(64)  # rank 0 beats once it holds every follower's link: the clock starts then
        link.settimeout(silence_s or None)
        while got and GOODBYE not in got:
            got = link.recv(64)
        why = "" if got else "closed; it died"
    except TimeoutError:
        why = f"sent no heartbeat for {silence_s:.1f} s; it is stopped or hung"
    except OSError as e:
        why = f"failed ({e}); it died"
    if why:
        logging.getLogger(__name__).error("rank %d: rank 0's link %s, so this rank exits", dist.get_rank(), why)
        exit_at_once(1)


def engine_urls(state: RankState) -> list[list[str]]:
    """Each rank's engines' URLs, by rank: rank 0 drives the engines its followers started."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, state.engine_urls)
    return out


def logprobs(state: RankState, batch):
    return state.trainer.logprobs(batch)


def engine_weights(state: RankState) -> dict:
    """The export engines load, built once per cell: on the first data-parallel replica's
    tensor-parallel ranks, gathered to rank 0 (the publisher); every other rank returns {}."""
    from megatron.core import parallel_state

    if parallel_state.get_data_parallel_rank() != 0:
        return {}
    return state.trainer.engine_weights(to_first=True)


RANK_OPS = (
    frozenset({load_engine_dir, logprobs, engine_weights, save, load_latest, ping, link, engine_urls}) | SHARD_OPS
)
"""What rank 0 may ask of every rank: functions (RankState, *args), announced by reference (pickle
names their module and name), so a reader or a tool can follow each call to its definition."""

KEEPALIVE_S = 60.0
"""An idle cell's rank 0 pings its followers this often (a quarter of the group's timeout if that
is shorter, `trainer.collective_timeout_s`), which a follower waiting for the next announcement
would otherwise run into."""

GOODBYE = b"."
"""What rank 0 sends on a link when it is done with the follower (heartbeats are any other byte)."""
LINK_TIMEOUT_S = 60.0
"""How long rank 0 waits for its followers' links (they connect as soon as the announcement reaches them)."""
LINK_HELLO_S = 10.0
"""A follower names its rank as soon as it connects."""


def _hello(sock: socket.socket) -> int:
    """The rank a new link names (-1: none within LINK_HELLO_S)."""
    sock.settimeout(LINK_HELLO_S)
    try:
        with sock.makefile("rb") as hello:
            return int(hello.readline())
    except (OSError, ValueError):
        return -1


class FollowerLink:
    """A follower seen through the TCP link it opened to rank 0. `poll` mirrors `Popen.poll`: None
    while the follower lives, else why it is taken for dead: its link closed (the kernel closes a
    dead process's sockets), or, with `silence_s`, no heartbeat for that long (a stopped process's
    kernel still answers TCP, so only its silence tells)."""

    def __init__(self, sock: socket.socket, silence_s: float = 0.0):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)  # a node gone: ~11 s (5 + 3 x 2)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 5)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 2)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
        sock.setblocking(False)
        self.sock, self.silence_s = sock, silence_s
        self.heard, self.told = time.monotonic(), float("-inf")

    def poll(self, closing_counts: bool = True) -> str | None:
        """`closing_counts` False: only silence counts (a child's exit code says more)."""
        try:
            while self.sock.recv(4096):  # heartbeats, all read
                self.heard = time.monotonic()
            closed = "unknown (its link to rank 0 closed)"
        except BlockingIOError:
            closed = None
        except OSError as e:
            closed = f"unknown (its link to rank 0 failed: {e})"
        if closed and closing_counts:
            return closed
        silent = time.monotonic() - self.heard
        if self.silence_s and silent > self.silence_s:
            return f"unknown (no heartbeat for {silent:.1f} s: stopped or hung)"
        return None

    def beat(self) -> None:
        """Rank 0's heartbeat to the follower, four a `silence_s` (it exits when they stop)."""
        if self.silence_s and time.monotonic() - self.told >= self.silence_s / 4:
            self.told = time.monotonic()
            self._send(b"h")

    def goodbye(self) -> None:
        """Rank 0 is done with the follower: its link closing from now on is no death."""
        self._send(GOODBYE)

    def _send(self, byte: bytes) -> None:
        try:
            self.sock.send(byte)  # one byte into a nearly empty buffer: never blocks
        except OSError:
            pass  # the follower is gone already (its poll says so)


class ChildRank:
    """A follower that is this process's child: its exit code once it exits, else its link's
    silence (`FollowerLink`; None: exits only)."""

    def __init__(self, proc: subprocess.Popen, link: FollowerLink | None):
        self.proc, self.link = proc, link

    def poll(self) -> int | str | None:
        code = self.proc.poll()
        if code is not None or self.link is None:
            return code
        return self.link.poll(closing_counts=False)


class CellRanks:
    """Rank 0's handle on its cell's ranks (with one rank, a plain call).

    Args:
        followers: ranks 1.. as child processes (`start_followers`): watched, and if one exits
            before `stop`, or (with `trainer.rank_hang_timeout_s`) falls silent on its link,
            `on_lost(rank, exit code or why)` is called (from the watching thread): any rank lost
            is the cell lost.
        link_host: followers that are not children (srun-placed): each links to rank 0 on this
            address (`FollowerLink`), and is watched through it like a child.
        keepalive_s: ping idle followers this often (default: KEEPALIVE_S, or a quarter of the
            group's timeout if shorter).
    """

    def __init__(
        self,
        trainer: Trainer,
        followers: list[subprocess.Popen] = (),
        on_lost=None,
        keepalive_s: float | None = None,
        link_host: str | None = None,
    ):
        self.state = RankState(trainer)
        """This rank's trainer, endpoint and buffers (gyre/train/shard.py)."""
        self.num_ranks = dist.get_world_size()
        self._order = threading.Lock()  # the leader's thread and the step's worker: one announcement at a time
        self._last = time.monotonic()
        self._stopped = threading.Event()
        if dist.get_rank() != 0:
            raise RuntimeError(f"CellRanks drives from rank 0; rank {dist.get_rank()} must follow()")
        silence_s = trainer.cfg.rank_hang_timeout_s
        link_host = link_host or ("127.0.0.1" if followers and silence_s else None)  # children: this machine
        linked = link_host is not None and self.num_ranks > 1
        self._links = self._accept_links(link_host, silence_s) if linked else {}
        children = {rank: ChildRank(proc, self._links.get(rank)) for rank, proc in enumerate(followers, start=1)}
        self._watched = self._links | children
        if keepalive_s is None:
            keepalive_s = min(KEEPALIVE_S, trainer.cfg.collective_timeout_s / 4)
        if self.num_ranks > 1:
            threading.Thread(target=self._keepalive, args=(keepalive_s,), daemon=True, name="ranks-ping").start()
        if self._watched:
            threading.Thread(target=self._watch, args=(on_lost,), daemon=True, name="ranks").start()

    @property
    def trainer(self) -> Trainer:
        return self.state.trainer

    def run(self, op: Callable[..., T], *args) -> T:
        """Run `op` (one of RANK_OPS) on every rank of the cell; returns rank 0's result."""
        if op not in RANK_OPS:
            raise ValueError(f"{op.__qualname__} is not a rank operation (gyre.train.ranks.RANK_OPS)")
        use_device(self.trainer.flat.weights.device)  # callers' threads (the step's worker) start on GPU 0
        if self.num_ranks == 1:
            return op(self.state, *args)
        with self._order:
            if self._stopped.is_set():
                raise RuntimeError(f"{op.__name__}: the cell's ranks were stopped")
            self._last = time.monotonic()
            dist.broadcast_object_list([(op, args)], src=0)
            return op(self.state, *args)

    def _keepalive(self, every_s: float) -> None:
        use_device(self.trainer.flat.weights.device)  # broadcast_object_list stages on the current device
        # never less than every_s / 10: an operation holding the group for long must not make this spin
        while not self._stopped.wait(max(every_s / 10, self._last + every_s - time.monotonic())):
            if time.monotonic() - self._last >= every_s and self._order.acquire(blocking=False):
                try:
                    if not self._stopped.is_set():
                        self._last = time.monotonic()
                        dist.broadcast_object_list([(ping, ())], src=0)
                finally:
                    self._order.release()

    def _accept_links(self, host: str, silence_s: float) -> dict[int, FollowerLink]:
        """Announce `link` and take every follower's link: {rank: FollowerLink}, silent after
        `silence_s` without a heartbeat (four a period). A connection that does not name a follower
        rank at once (something else that found the port) is dropped."""
        with socket.create_server((host, 0)) as server:
            server.settimeout(LINK_TIMEOUT_S)
            self.run(link, host, server.getsockname()[1], silence_s)
            links = {}
            while len(links) < self.num_ranks - 1:
                sock, peer = server.accept()
                rank = _hello(sock)
                if rank in links or not 0 < rank < self.num_ranks:
                    logging.getLogger(__name__).warning("link from %s dropped: rank %d is no follower's", peer, rank)
                    sock.close()
                    continue
                links[rank] = FollowerLink(sock, silence_s)
        for follower in links.values():
            follower.beat()  # every link is in: the followers' clocks on rank 0's silence start now
        return links

    def _watch(self, on_lost) -> None:
        while not self._stopped.wait(0.2):
            for follower in self._links.values():
                follower.beat()
            for rank, follower in self._watched.items():
                code = follower.poll()
                if code is not None and not self._stopped.is_set():
                    on_lost(rank, code)
                    return

    def stop(self, timeout_s: float = 30.0) -> None:
        """Release the followers (their `follow` returns). If an operation still holds the group past
        `timeout_s` (a rank died mid-collective), give up: the followers die with this process."""
        if self.num_ranks > 1 and self._order.acquire(timeout=timeout_s):
            try:
                if not self._stopped.is_set():
                    self._stopped.set()
                    use_device(self.trainer.flat.weights.device)
                    try:
                        dist.broadcast_object_list([None], src=0)
                    except RuntimeError as e:  # a rank is gone (the cell is lost): the rest go with us
                        logging.getLogger(__name__).warning("stopping the cell's ranks: a rank is gone: %s", e)
                        return
                    for follower in self._links.values():
                        follower.goodbye()
            finally:
                self._order.release()
        self._stopped.set()


def follow(trainer: Trainer, host: str | None = None, engine_urls: Sequence[str] = ()) -> Counter:
    """On ranks 1..n-1: run what rank 0 announces until it stops; returns how often each op ran.
    `host`: this rank's own address for its Mooncake endpoint (None: rank 0's, the same machine);
    `engine_urls`: the engines it started (its node's, on Slurm)."""
    state, done = RankState(trainer, host, engine_urls=list(engine_urls)), Counter()
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            return done
        op, args = box[0]
        if op not in RANK_OPS:
            raise RuntimeError(f"rank 0 announced {op!r}, not a rank operation")
        op(state, *args)
        done[op.__name__] += 1


def start_followers(
    num_ranks: int, host: str, master_port: int, model: ModelConfig, cfg: TrainerConfig, seed: int, log_dir: str
) -> list:
    """Spawn ranks 1..num_ranks-1 of this process's cell and make this process rank 0 (call before
    building its Trainer, whose init is the group's rendezvous). They die with this process.

    Args:
        master_port: the group's store, which this process binds when it builds its Trainer: keep
            it reserved until then (gyre.common.ports.PortReservation).

    Returns:
        The followers' Popen objects (their output in `log_dir`/rank<r>.<pid>.log).
    """
    group = {"WORLD_SIZE": str(num_ranks), "MASTER_ADDR": host, "MASTER_PORT": str(master_port)}
    os.environ.update(group | {"RANK": "0"})
    config = {"model": dataclasses.asdict(model), "trainer": dataclasses.asdict(cfg), "seed": seed}
    path = write_child_config(RunPaths(log_dir).ranks_config(os.getpid()), config)
    cmd = [sys.executable, "-m", "gyre.train.ranks", "--config", path]
    return [
        spawn_child(cmd, RunPaths(log_dir).rank_log(rank, os.getpid()), env=os.environ | group | {"RANK": str(rank)})
        for rank in range(1, num_ranks)
    ]


def main(argv: list[str] | None = None) -> NoReturn:
    parser = argparse.ArgumentParser(description="a follower rank of a multi-rank cell")
    parser.add_argument("--config", required=True, help="a JSON file {model, trainer, seed} (start_followers)")
    config = read_child_config(parser.parse_args(argv).config)
    run_follower(ModelConfig(**config["model"]), TrainerConfig(**config["trainer"]), config["seed"])
    exit_at_once(0)  # rank 0 stopped it; its process group is destroyed


def run_follower(
    model: ModelConfig, cfg: TrainerConfig, seed: int, host: str | None = None, engine_urls: Sequence[str] = ()
) -> Counter:
    """Be one follower rank (RANK, WORLD_SIZE, MASTER_ADDR/PORT set) until rank 0 stops; returns how
    often each operation ran. A spawned rank (`main`) and a Slurm task (gyre.cells.slurm, with its
    node's `host` and the engines it started there) both come here."""
    import torch

    torch.set_num_threads(1)
    done = follow(Trainer(model, cfg, seed), host, engine_urls)
    dist.destroy_process_group()
    return done


if __name__ == "__main__":
    from gyre.train import ranks  # the importable module: rank 0 announces its functions, not __main__'s

    ranks.main()
