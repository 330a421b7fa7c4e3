"""The control transport's contract, run over every backend: peers in separate processes exchange
every message type intact; a peer that sends garbage is an error on its channel only; a killed
peer is a ChannelClosed (never a hang, never an abort of this process)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gyre.control import messages as m
from gyre.control.transport import ChannelClosed, ChannelTimeout, connect, listen
from gyre.engines.published import PublishedWeights
from gyre.trajectory.sample import PackedBatch

PEER = Path(__file__).with_name("control_peer.py")
ROOT = Path(__file__).resolve().parents[2]
BACKENDS = ["tcp", "mpi"]


@pytest.fixture(params=BACKENDS)
def listener(request, tmp_path):
    if request.param == "mpi":
        pytest.importorskip("mpi4py")
    lst = listen(request.param, port_file=str(tmp_path / "control.port"))
    yield lst
    lst.close()


@pytest.fixture
def peers(tmp_path):
    started = []

    def start(address: str, mode: str, *args: str) -> subprocess.Popen:
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        log = open(tmp_path / f"peer{len(started)}.log", "w")
        # MPI peers get their own MPI world (two singletons cannot connect: see gyre/control/mpi.py)
        launcher = [str(Path(sys.executable).with_name("mpiexec")), "-n", "1"] if address.startswith("mpi:") else []
        cmd = [*launcher, sys.executable, str(PEER), address, mode, *args]
        started.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=log))
        return started[-1]

    yield start
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)


def _every_message() -> list:
    t = torch.arange(6)
    batch = PackedBatch(
        tokens=t,
        position_ids=t,
        cu_seqlens=torch.tensor([0, 6], dtype=torch.int32),
        target_mask=t > 2,
        behaviour_logprobs=-t.float(),
        loss_weights=torch.ones(6),
        advantages=t.float() - 2,
        weight_versions=t * 0,
        execution_ids=("e0",),
    )
    return [
        m.Join("cell2", [("w", (2, 3))]),
        m.Welcome([("127.0.0.1:1", 4096, 8192)], 3),
        m.Refused("no"),
        m.Claim("cell2"),
        m.Work(index=1, version=2, slot=1, batch=batch),
        m.Wait(),
        m.Evicted(),
        m.Done(1, {"loss_sum": 0.5}, 0.25),
        m.Pull("cell2"),
        m.PullDone("cell2"),
        m.RoleSwitch(2, "train"),
        m.PhaseDone(2, "pull_weights", 0.125, [0.125, 0.0625]),
        m.Heartbeat(2, 12.5),
        m.WeightVersion(7),
        m.Failure("cell3", "engine exited 1"),
        m.CellReady(
            0,
            ["http://127.0.0.1:1", "http://127.0.0.1:3"],
            "tcp://127.0.0.1:2/00",
            PublishedWeights(0, "disk", {"path": "/w/0"}),
            0,
            "ab12",
        ),
        m.RoleDone(2, "train", 10.5, {"stop_admission": 0.01}, {"stop_admission": [0.01, 0.005]}),
        m.MicroBatches(3, 0, []),
        m.EndStep(3),
        m.StepProgress(3, [(3, 0, 0)]),
        m.StepDone(3, 4, {"loss": 0.5}, PublishedWeights(4, "mooncake", {"address": 1}), 2.5),
        m.SaveCheckpoint(4, {"next_group": 16}),
        m.CheckpointDone(4, "/ckpt/step_00000004", 1.5, "ab12"),
        m.Stop(),
        m.Leave("cell2"),
    ]


def test_garbage_then_a_kill_drop_only_that_peer_and_the_next_peer_round_trips_every_message(listener, peers):
    """Over each backend, peers in separate processes: undecodable bytes, a non-message and a
    forbidden global are ProtocolErrors on that channel, which still works; SIGKILL of the peer is
    a ChannelClosed within the heartbeat timeout (never a hang, never an abort of this process);
    the listener then serves a new peer that echoes every message type intact."""
    peers(listener.address, "garbage")
    ch = listener.accept(timeout_s=60)
    for expected in ("undecodable", "not a control message", "may not contain"):
        with pytest.raises(m.ProtocolError, match=expected):
            ch.recv(timeout_s=30)
    hello = ch.recv(timeout_s=30)  # the channel still works
    assert isinstance(hello, m.Heartbeat) and hello.t == 0.0
    with pytest.raises(ChannelTimeout):
        ch.recv(timeout_s=0.2)
    os.kill(hello.cell, signal.SIGKILL)  # the peer's own process (under mpiexec: not the launcher)
    t0 = time.monotonic()
    with pytest.raises(ChannelClosed):
        while time.monotonic() - t0 < 60:
            try:
                ch.recv(timeout_s=1)
            except ChannelTimeout:
                pass  # MPI: silence until the heartbeat timeout; TCP: EOF at once
    ch.close()

    peers(listener.address, "echo")
    ch = listener.accept(timeout_s=60)
    sent = _every_message()
    assert {type(x).__name__ for x in sent} == set(m.MESSAGES)
    for msg in sent:
        back = ch.request(msg, timeout_s=30)
        if isinstance(msg, m.Work):
            assert (back.index, back.version, back.slot) == (msg.index, msg.version, msg.slot)
            assert all(
                torch.equal(getattr(back.batch, f), getattr(msg.batch, f))
                for f in ("tokens", "advantages", "cu_seqlens")
            )
        else:
            assert back == msg
    ch.close()


def test_connecting_to_a_closed_tcp_listener_is_channel_closed():
    lst = listen("tcp")
    address = lst.address
    lst.close()
    with pytest.raises(ChannelClosed, match="cannot connect"):
        connect(address)
    with pytest.raises(ValueError, match="unknown control"):
        connect("udp://x")


def _listened_s(log: Path) -> float:
    """How long an echo peer has listened without a message and without finding its listener silent."""
    lines = [line for line in log.read_text().splitlines() if line.startswith("listened ")]
    return float(lines[-1].split()[1]) if lines else 0.0


def test_an_mpi_peer_the_listener_has_not_handed_out_yet_still_hears_it(peers, tmp_path):
    """MPI declares a silent peer dead after 5 s: the listener heartbeats every peer it accepted from
    the start, not only once `accept()` hands the channel out (a coordinator takes cells one by one).
    (A TCP peer's connect returns only in `accept()`: nothing to hear before.)"""
    pytest.importorskip("mpi4py")
    listener = listen("mpi", port_file=str(tmp_path / "control.port"))
    peer = peers(listener.address, "echo")
    deadline = time.monotonic() + 120
    while _listened_s(tmp_path / "peer0.log") <= 5:  # longer than the peer's silence timeout
        assert peer.poll() is None, (tmp_path / "peer0.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "the peer never listened past its silence timeout"
        time.sleep(0.1)
    ch = listener.accept(timeout_s=60)
    assert ch.request(m.WeightVersion(3), timeout_s=30) == m.WeightVersion(3)
    ch.send(m.Leave("x"))
    ch.close()
    listener.close()


@pytest.mark.timeout(300)
def test_sends_to_a_killed_mpi_peer_fail_and_the_listeners_other_peer_keeps_its_channel(peers, tmp_path):
    """MPICH retries a send its network cannot take without end, and every MPI call of a process
    holds one lock: a send to a SIGKILLed peer that had been talking once blocked the coordinator
    and starved its other channels. Bounded by MPI_OFI_set_eagain, the send fails instead and the
    channel declares its peer dead, long before the silence timeout (600 s here), and a peer with
    Slurm's 30 s timeout still round-trips afterwards."""
    pytest.importorskip("mpi4py")
    listener = listen("mpi", port_file=str(tmp_path / "control.port"), peer_timeout_s=600)
    peers(listener.address, "chatter")
    victim = listener.accept(timeout_s=60)
    pid = victim.recv(timeout_s=30).cell
    peers(listener.address, "echo", "30")
    survivor = listener.accept(timeout_s=60)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 120  # a fifth of the silence timeout
    with pytest.raises(ChannelClosed, match="send failed"):
        while time.monotonic() < deadline:  # as the coordinator does: sends, and reads what comes
            victim.send(m.WeightVersion(0))
            try:
                victim.recv(timeout_s=0.02)
            except ChannelTimeout:
                pass
    assert survivor.request(m.WeightVersion(3), timeout_s=30) == m.WeightVersion(3)
    victim.close()
    survivor.send(m.Leave("x"))
    survivor.close()
    listener.close()
