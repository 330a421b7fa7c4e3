"""A satellite cell's training role (`SatelliteCell`) and its process entry point.

    python -m gyre.train.satellite --cell NAME --model '{...ModelConfig...}' \
        --trainer '{...TrainerConfig...}' [--core ADDR]

Without --core the cell prepares (imports, builds the model, opens its Mooncake endpoint), prints
`ready` and reads the core's address from stdin: a warm cell joins a running step within
milliseconds. SIGTERM makes it leave after the micro-step in progress (nothing is redone). On exit
it prints one JSON line: micro-steps computed and weight-pull times.
"""

import argparse
import signal
import sys
import threading
import time

from gyre.common import jsonio
from gyre.control import messages as m
from gyre.control.transport import Channel, ChannelClosed, connect
from gyre.models.config import ModelConfig
from gyre.train.config import TrainerConfig
from gyre.train.elastic import ElasticError
from gyre.train.ranks import CellRanks
from gyre.train.shard import satellite_close, satellite_compute, satellite_open, satellite_peer, satellite_pull
from gyre.train.trainer import Trainer
from gyre.transfer import TransferEndpoint


class SatelliteCell:
    """A satellite's side: join the core as `cell`, pull weights per version, compute claimed micro-steps.

    One channel for the cell's life (rejoined if the core evicted it), so `serve` can run again
    after a stint in another role, and `pull_latest` works at any time. A cell of several ranks
    (`ranks`, driven from this rank 0) pulls and writes rank to rank (gyre/train/shard.py): each
    claim round asks for one micro-step per data-parallel replica, and the core names the replica
    of each (its slot lives on that replica's core ranks).
    """

    def __init__(
        self,
        trainer: Trainer,
        endpoint: TransferEndpoint,
        core_address: str,
        cell: str,
        peer_timeout_s: float = 5.0,
        ranks: CellRanks | None = None,
        host: str = "127.0.0.1",
    ):
        """`peer_timeout_s`: an MPI core is declared dead after this silence (gyre.control.transport.connect);
        `host`: the interface of the follower ranks' Mooncake endpoints."""
        self.trainer, self.endpoint, self.cell = trainer, endpoint, cell
        self.ranks = ranks or CellRanks(trainer)
        self.ranks.state.endpoint = endpoint
        self.ranks.run(satellite_open, host)
        self._replicas = self.ranks.num_ranks // trainer.cfg.tensor_parallel_size
        self._address, self._peer_timeout_s = core_address, peer_timeout_s
        self._ch: Channel | None = None
        self._rpc = threading.Lock()  # one request/reply exchange at a time on the channel
        self._weights = threading.Lock()  # a pull never overwrites weights a micro-step is using
        self.version = -1
        """Weight version held now (-1: never pulled)."""
        self.num_computed = 0
        self.pull_seconds: list[float] = []
        """Per pull: its slowest rank's read."""
        self.rank_pull_seconds: list[float] = []
        """The last pull's read by rank."""
        self.microstep_seconds: list[float] = []
        """Per micro-step: forward, backward and the gradient write to the core."""
        self._join()

    def _join(self) -> Channel:
        if self._ch is None:
            ch = connect(self._address, peer_timeout_s=self._peer_timeout_s)
            join = m.Join(
                self.cell, self.trainer.flat.signature(), self.ranks.num_ranks, self.trainer.cfg.tensor_parallel_size
            )
            reply = ch.request(join, timeout_s=60)
            if not isinstance(reply, m.Welcome):
                ch.close()
                raise ElasticError(f"core refused {self.cell}: {getattr(reply, 'reason', reply)}")
            self.ranks.run(satellite_peer, reply.peers)
            self._ch = ch
        return self._ch

    def _drop(self) -> None:
        if self._ch is not None:
            self._ch.close()
            self._ch = None

    def serve(self, stop: threading.Event) -> int:
        """Claim and compute micro-steps until `stop` is set (then finish the one in progress and
        say Leave), the core evicts this cell, or the core goes away.

        Returns:
            The number of micro-steps computed by this call.
        """
        computed = 0
        try:
            ch = self._join()
            while not stop.is_set():
                works, reply = self._claim(ch)
                if works:
                    self._compute(ch, works)
                    computed += len(works)
                if isinstance(reply, m.Evicted):
                    self._drop()  # presumed hung: the core redid our work; the next serve rejoins
                    self.version = -1  # and pulls again (a pull cut short by eviction may be torn)
                    return computed
                if not works:
                    stop.wait(self.trainer.cfg.claim_poll_s)
            ch.send(m.Leave(self.cell))
        except ChannelClosed:
            self._drop()  # the core closed: this cell's training role is over
        return computed

    def _claim(self, ch: Channel) -> tuple[list[m.Work], object]:
        """Claim up to one micro-step per replica; returns (the Work granted, the last reply)."""
        works, reply = [], None
        with self._rpc:
            while len(works) < self._replicas:
                reply = ch.request(m.Claim(self.cell))
                if not isinstance(reply, m.Work):
                    break
                works.append(reply)
        if reply is not None and not isinstance(reply, (m.Work, m.Wait, m.Evicted)):
            raise m.ProtocolError(f"the core answered a Claim with {type(reply).__name__}")
        return works, reply

    def _compute(self, ch: Channel, works: list[m.Work]) -> None:
        jobs = [None] * self._replicas
        for w in works:
            if not 0 <= w.replica < self._replicas or jobs[w.replica] is not None:
                raise m.ProtocolError(f"the core granted replica {w.replica} twice or out of {self._replicas}")
            jobs[w.replica] = (w.batch, w.slot)
        with self._weights:
            if works[0].version != self.version:
                self._read_weights()  # safe: the core cannot step while we hold a claim
                self.version = works[0].version
            done = self.ranks.run(satellite_compute, jobs)
        for work in works:
            stats, seconds, _, rank = done[work.replica]
            self.microstep_seconds.append(seconds)
            ch.send(m.Done(work.index, stats, seconds, rank, work.replica))
            self.num_computed += 1

    def pull_latest(self) -> tuple[int, float]:
        """Copy the core's newest weights now (any time: the core holds its optimizer step meanwhile).

        Returns:
            (version pulled, seconds from the request to the copy's end)
        """
        t0 = time.perf_counter()
        ch = self._join()
        with self._rpc:
            reply = ch.request(m.Pull(self.cell))
        if not isinstance(reply, m.WeightVersion):
            raise m.ProtocolError(f"the core answered a Pull with {type(reply).__name__}")
        try:
            with self._weights:
                self._read_weights()
                self.version = reply.version
        finally:
            ch.send(m.PullDone(self.cell))
        return reply.version, time.perf_counter() - t0

    def _read_weights(self) -> None:
        self.rank_pull_seconds = self.ranks.run(satellite_pull)
        self.pull_seconds.append(max(self.rank_pull_seconds))

    def close(self) -> None:
        """Leave the core for good (the channel closes; the core releases anything held)."""
        self._drop()
        satellite_close(self.ranks.state)  # this rank's; the followers' go with their processes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="ModelConfig fields as JSON")
    parser.add_argument("--trainer", required=True, help="TrainerConfig fields as JSON")
    parser.add_argument("--cell", required=True, help="this cell's name (e.g. cell2: the scheduler's cell index)")
    parser.add_argument("--core", help="the core's control address (tcp://... or mpi:...); read from stdin if absent")
    parser.add_argument("--host", default="127.0.0.1", help="interface of this cell's Mooncake endpoint")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    trainer = Trainer(ModelConfig(**jsonio.loads(args.model)), TrainerConfig(**jsonio.loads(args.trainer)))
    endpoint = TransferEndpoint(args.host)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    address = args.core
    if address is None:
        print("ready", flush=True)
        address = sys.stdin.readline().strip()
    cell = SatelliteCell(trainer, endpoint, address, args.cell)
    print(f"joined {cell.cell}", flush=True)
    computed = cell.serve(stop)
    cell.close()
    endpoint.close()
    print(jsonio.dumps({"cell": cell.cell, "computed": computed, "pull_s": cell.pull_seconds}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
