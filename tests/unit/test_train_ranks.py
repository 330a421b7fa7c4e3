"""A core cell of two ranks over gloo (tensor-parallel 2, or data-parallel 2) trains the same
streamed steps as the one-rank core: rank 0 runs the CoreServer and drives, rank 1 follows. Its
first step is the core's alone; a satellite cell of the same two-rank layout computes every
micro-step of its second (rank r pulls from and writes to core rank r over Mooncake), and the core
ends bit for bit where the same layout training alone (`Trainer.train_step`) ends. The ranks start
from the one-rank core's checkpoint (model and Adam state, resharded to TP=2 by dist_checkpointing
on load) and save theirs, which one rank loads back.

Data parallel 2 sums micro-steps in index order (Trainer.fold), so its log-probs, gradient norms
and weights equal the one-rank core's bit for bit; tensor parallel 2 splits each matmul, so its
log-probs agree within 1e-6 and its weights after two Adam steps within 1% of one step's move (lr).
Under data parallel, Adam's state is sharded over the replicas (ZeRO stage 1) and still bit for bit.
"""

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from _train_ref import random_batches, two_rank_env

from gyre.models.config import ModelConfig
from gyre.train.checkpoint import CheckpointManager
from gyre.train.config import TrainerConfig
from gyre.train.elastic import CoreServer
from gyre.train.ranks import FollowerLink, _hello
from gyre.train.trainer import Trainer
from gyre.transfer import TransferEndpoint

MODEL = ModelConfig(
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=96,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=64,
    max_seq_len=256,
)
CFG = TrainerConfig(lr=1e-3, num_grad_slots=1)  # one slot a replica: a DP=2 satellite still holds two claims
ROOT = Path(__file__).resolve().parents[2]
STEPS = [(5, 11), (3, 12)]  # (micro-batches, seed) of each streamed step

_RANK_SCRIPT = """
import sys, torch
from gyre.common.serve import exit_at_once
from dataclasses import replace
from _train_ref import random_batches
from test_train_ranks import MODEL, CFG, STEPS, stream_steps
from gyre.train.checkpoint import CheckpointManager
from gyre.train.ranks import CellRanks, follow, load_latest, logprobs, save
from gyre.train.shard import weights_digest
from gyre.train.trainer import Trainer

def main(tp, src, dst, out):
    torch.set_num_threads(1)
    cfg = replace(CFG, tensor_parallel_size=int(tp))
    alone = Trainer(MODEL, cfg, seed=9)  # the same layout training alone: the bitwise reference
    CheckpointManager(src, 1).load_latest(alone)
    for n, seed in STEPS:
        alone.train_step(random_batches(MODEL, n, 3, seed=seed))
    tr = Trainer(MODEL, cfg, seed=9)
    if torch.distributed.get_rank():
        follow(tr)
    else:
        from gyre.train.elastic import CoreServer
        from gyre.transfer import TransferEndpoint
        ranks = CellRanks(tr)
        ranks.run(load_latest, src, 1)
        lp = ranks.run(logprobs, random_batches(MODEL, 1, 3, seed=5)[0])
        server = CoreServer(tr, TransferEndpoint(), ranks=ranks)
        metrics = stream_steps(server, src + ".core")
        version, _ = server.publish()
        engine = {k: v.clone() for k, v in server.published_tensors(version).items()}
        ranks.run(save, dst, 1, None)
        digest = ranks.run(weights_digest)
        server.close()
        ranks.stop()
    same, owned = [None, None], [None, None]
    torch.distributed.all_gather_object(same, torch.equal(tr.flat.weights, alone.flat.weights))
    moments = [p for g in tr.local_optimizer.param_groups for p in g["params"]]
    torch.distributed.all_gather_object(owned, (sum(p.numel() for p in moments), tr.flat.weights.numel()))
    if not torch.distributed.get_rank():
        shard0 = tr.flat.weights.detach().clone()
        got = dict(logprobs=lp, metrics=metrics, engine=engine, step=tr.step, same=same, digest=digest, shard0=shard0,
                   owned=owned)
        torch.save(got, out)
    torch.distributed.destroy_process_group()
    exit_at_once(0)  # as a rank ends in gyre.train.ranks: no teardown of torch's native threads

if __name__ == "__main__":
    main(*sys.argv[1:])
"""


_SATELLITE_SCRIPT = """
import json, os, sys, threading, time, torch
from gyre.common.serve import exit_at_once
from dataclasses import replace
from test_train_ranks import MODEL, CFG
import gyre.train.ranks as ranks_module
from gyre.train.ranks import CellRanks, follow
from gyre.train.satellite import SatelliteCell
from gyre.train.trainer import Trainer
from gyre.transfer import TransferEndpoint

def main(tp, address_file, out):
    torch.set_num_threads(1)
    tr = Trainer(MODEL, replace(CFG, tensor_parallel_size=int(tp)), seed=3)
    if torch.distributed.get_rank():
        # rank 0 waits for this file: its idle follower was pinged. `ping` stays the same function
        # (rank ops are announced and checked by identity), with a body that says it ran
        ranks_module.PINGED = out + ".pinged"
        ranks_module.ping.__code__ = (lambda state: open(PINGED, "w").close()).__code__
        json.dump(follow(tr, "127.0.0.1"), open(out + ".rank1", "w"))  # its own endpoint's address
    else:
        lost = []  # rank 1 is not this process's child (as on Slurm): watched through its link
        ranks = CellRanks(tr, on_lost=lambda *why: lost.append(why), keepalive_s=0.1, link_host="127.0.0.1")
        while not os.path.exists(out + ".pinged"):  # idle: rank 1 waits in a collective, pinged
            time.sleep(0.05)
        while not os.path.exists(address_file):
            time.sleep(0.05)
        sat = SatelliteCell(tr, TransferEndpoint(), open(address_file).read(), "cell1", ranks=ranks)
        computed = sat.serve(threading.Event())  # until the core closes
        sat.close()
        ranks.stop()
        pulls = {"pull_s": sat.pull_seconds, "rank_pull_s": sat.rank_pull_seconds}
        json.dump({"computed": computed, **pulls, "lost": lost}, open(out, "w"))
    torch.distributed.destroy_process_group()
    exit_at_once(0)  # as a rank ends in gyre.train.ranks: no teardown of torch's native threads

if __name__ == "__main__":
    main(*sys.argv[1:])
"""


_HUNG_SCRIPT = """
import json, os, sys, time, torch
from dataclasses import replace
from test_train_ranks import MODEL, CFG
from gyre.common.ports import PortReservation
from gyre.train.ranks import CellRanks, start_followers
from gyre.train.trainer import Trainer

def main(log_dir, hang_s, out):
    torch.set_num_threads(1)
    cfg = replace(CFG, rank_hang_timeout_s=float(hang_s))
    lost = []
    with PortReservation() as master_port:  # as a local cell's leader does
        followers = start_followers(2, "127.0.0.1", master_port, MODEL, cfg, 0, log_dir)
        CellRanks(Trainer(MODEL, cfg, seed=0), followers, lambda *why: lost.append((time.time(), why)))
    print(followers[0].pid, flush=True)  # the test stops it (or this rank) now
    while not lost:
        time.sleep(0.01)
    json.dump({"at": lost[0][0], "why": lost[0][1]}, open(out, "w"))
    followers[0].kill()  # SIGKILL ends a stopped process too
    os._exit(0)  # as the leader does once a rank is lost

if __name__ == "__main__":
    main(*sys.argv[1:])
"""


def stream_steps(server: CoreServer, address_file: str | None = None) -> list[dict]:
    """STEPS as the leader streams them: open, add each micro-batch with its id, end, run. With
    `address_file`, a satellite is told the core's address once the second step's batches are all
    in (its first claims find every replica's slot free), and from then on the core only sums (the
    satellite computes every micro-step)."""
    out = []
    for n, seed in STEPS:
        if out and address_file:
            server.trainer.cfg = replace(server.trainer.cfg, core_computes_microsteps=False)
        step = server.trainer.step
        server.begin_step(step)
        for k, batch in enumerate(random_batches(MODEL, n, 3, seed=seed)):
            server.add_micro_batch(batch, (step, 0, k))
        server.end_step()
        if out and address_file:
            Path(address_file).write_text(server.address)
        out.append(server.run_step())
    return out


def test_a_follower_link_tells_a_dead_follower_from_a_live_one():
    """The kernel closes a dead process's sockets (SIGKILL too): closing the far end stands for that.
    A link names its rank first; a connection that names none is told apart (rank 0 drops it)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        for says, rank in ((b"1\n", 1), (b"", -1)):
            with socket.create_connection(server.getsockname()) as far:
                far.sendall(says)
                far.shutdown(socket.SHUT_WR)
                with server.accept()[0] as near:
                    assert _hello(near) == rank
        for far_end_ends in (lambda far: far.close(), lambda far: far.shutdown(socket.SHUT_WR)):
            far = socket.create_connection(server.getsockname())
            link = FollowerLink(server.accept()[0])
            assert link.poll() is None  # alive: nothing to read, no EOF
            far_end_ends(far)
            deadline = time.monotonic() + 10
            while (why := link.poll()) is None and time.monotonic() < deadline:  # the FIN crosses loopback
                time.sleep(0.01)
            assert why == "unknown (its link to rank 0 closed)"
            link.sock.close()
            far.close()
        # a stopped follower's link stays open (its kernel answers TCP): only its heartbeats stop
        with socket.create_connection(server.getsockname()) as far:
            link, beating_until = FollowerLink(server.accept()[0], silence_s=0.5), time.monotonic() + 1.0
            while time.monotonic() < beating_until:  # beating: alive past silence_s
                far.sendall(b"h")
                assert link.poll() is None
                time.sleep(0.05)
            while (why := link.poll()) is None and time.monotonic() < beating_until + 10:
                time.sleep(0.01)
            assert "no heartbeat" in why and time.monotonic() - beating_until >= 0.5 - 0.05
            link.sock.close()


def _digest(weights: torch.Tensor) -> str:
    return hashlib.sha256(weights.numpy().tobytes()).hexdigest()[:16]


def _start_ranks(script: str, args: list[str], log_prefix: Path, master_port: int) -> list[subprocess.Popen]:
    env = two_rank_env(master_port)
    return [
        subprocess.Popen(
            [sys.executable, "-c", script, *args],
            cwd=ROOT,
            env=env | {"RANK": str(r)},
            stdout=open(f"{log_prefix}{r}.log", "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for r in range(2)
    ]


@pytest.mark.parametrize("tp", [pytest.param(2, id="tp2"), pytest.param(1, id="dp2")])
def test_a_two_rank_core_with_a_two_rank_satellite_trains_streamed_steps_like_the_one_rank_core(
    tmp_path, tp, reserve_port
):
    one = Trainer(MODEL, CFG, seed=0)
    one.train_step(random_batches(MODEL, 1, 2, seed=4))  # non-zero Adam state to reshard
    CheckpointManager(tmp_path / "ckpt", keep_last=1).save(one)
    ckpt, sat_out = str(tmp_path / "ckpt"), str(tmp_path / "satellite.json")
    core_args = [str(tp), ckpt, str(tmp_path / "saved"), str(tmp_path / "out.pt")]
    ranks = _start_ranks(_RANK_SCRIPT, core_args, tmp_path / "rank", reserve_port())
    ranks += _start_ranks(_SATELLITE_SCRIPT, [str(tp), ckpt + ".core", sat_out], tmp_path / "satellite", reserve_port())
    lp = one.logprobs(random_batches(MODEL, 1, 3, seed=5)[0])
    server = CoreServer(one, TransferEndpoint())
    try:
        metrics = stream_steps(server)
    finally:
        server.close()
    try:
        codes = [p.wait(timeout=300) for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
    assert codes == [0] * 4, "".join((tmp_path / f"{n}0.log").read_text()[-3000:] for n in ("rank", "satellite"))
    got = torch.load(tmp_path / "out.pt", weights_only=False)
    assert got["step"] == one.step == 3
    assert got["same"] == [True, True]  # each core rank's shard: bit for bit the layout training alone
    expected = one.engine_weights()
    back = Trainer(MODEL, CFG, seed=3)  # the ranks' checkpoint, loaded by one rank
    CheckpointManager(tmp_path / "saved", keep_last=1).load_latest(back)
    assert back.step == 3
    first, second = got["metrics"]
    assert first["microsteps_by/core"] == metrics[0]["microsteps_by/core"]
    assert second["microsteps_by/cell1"] == STEPS[1][0] == json.load(open(sat_out))["computed"]
    pulled = json.load(open(sat_out))
    assert len(pulled["pull_s"]) == 1  # one version pulled, all ranks at once, as slow as its slowest rank
    assert len(pulled["rank_pull_s"]) == 2 and max(pulled["rank_pull_s"]) == pulled["pull_s"][0]
    assert pulled["lost"] == []  # its link closing after `stop` is no loss
    follower = json.load(open(sat_out + ".rank1"))
    assert follower["satellite_pull"] == 1 and follower["satellite_compute"] >= 2 and follower["ping"] >= 1
    assert follower["link"] == 1
    for m1, m2 in zip(metrics, got["metrics"]):
        assert [t[0] for t in m2["microsteps"]] == [t[0] for t in m1["microsteps"]]  # ids, in order
    if tp == 1:
        assert {t[5] for m in got["metrics"] for t in m["microsteps"]} == {0, 1}  # both replicas computed
        assert {t[5] for t in second["microsteps"]} == {0, 1}  # both of the satellite's, too
        assert second["microsteps_in_flight_max"] == 2 > CFG.num_grad_slots  # one claim a replica at once
        assert torch.equal(got["logprobs"], lp)
        assert [m["grad_norm"] for m in got["metrics"]] == [m["grad_norm"] for m in metrics]
        assert all(torch.equal(t, expected[name]) for name, t in got["engine"].items())
        assert torch.equal(back.flat.weights, one.flat.weights)
        assert got["digest"] == _digest(one.flat.weights)  # the one-rank core's digest of the same weights
        # Adam's state is sharded over the two replicas (each holds some, together all), and their
        # checkpoint holds every moment: loaded by one rank, the one-rank core's bit for bit
        (mine, total), (theirs, _) = got["owned"]
        assert 0 < mine < total and mine + theirs == total
        for pa, pb in zip(one.flat.params, back.flat.params):
            a, b = one.optimizer.state[pa], back.optimizer.state[pb]
            assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
    else:
        _assert_tensor_parallel_close(got, metrics, lp, expected, (back.flat.weights - one.flat.weights).abs().max())


def _assert_tensor_parallel_close(got: dict, metrics: list, lp, expected: dict, weights_off: float) -> None:
    """TP=2 against the one-rank core: log-probs and grad norms within 1e-6; Adam moves a weight by
    about lr per step whatever its gradient's size, so the split matmuls' rounding can move
    small-gradient weights differently: within 1% of one step (measured 0.13%)."""
    assert (got["logprobs"] - lp).abs().max() <= 1e-6
    for m1, m2 in zip(metrics, got["metrics"]):
        assert abs(m2["grad_norm"] - m1["grad_norm"]) <= 1e-6 * m1["grad_norm"]
    for name, t in got["engine"].items():
        assert (t - expected[name]).abs().max() <= 0.01 * CFG.lr, name
    assert weights_off <= 0.01 * CFG.lr
    assert got["digest"] != _digest(got["shard0"])  # both shards digested, not rank 0's alone


@pytest.mark.parametrize("stopped", ["follower", "rank0"])
def test_a_stopped_rank_is_found_within_the_hang_timeout(tmp_path, stopped, reserve_port):
    """A rank stopped with SIGSTOP neither exits nor closes its link (its kernel still answers TCP):
    its heartbeats stop. A stopped follower is declared lost by rank 0 (the cell is lost), and the
    followers of a stopped rank 0 exit, each within `rank_hang_timeout_s`."""
    hang_s, out = 5.0, tmp_path / "lost.json"  # far over a loaded box's scheduling delays
    args = [str(tmp_path), str(hang_s), str(out)]
    rank0 = subprocess.Popen(
        [sys.executable, "-c", _HUNG_SCRIPT, *args],
        cwd=ROOT,
        env=two_rank_env(reserve_port()),
        stdout=subprocess.PIPE,
        text=True,
    )
    follower = None
    try:
        follower = int(rank0.stdout.readline())  # once the cell is up and linked
        stopped_at = time.time()
        os.kill(follower if stopped == "follower" else rank0.pid, signal.SIGSTOP)
        if stopped == "follower":
            assert rank0.wait(timeout=60) == 0, (tmp_path / f"rank1.{rank0.pid}.log").read_text()[-3000:]
            lost = json.loads(out.read_text())
            assert lost["why"][0] == 1 and "no heartbeat" in lost["why"][1]
            found_at = lost["at"]
        else:
            found_at = _exited_at(follower, timeout_s=60)
            assert "it is stopped or hung" in (tmp_path / f"rank1.{rank0.pid}.log").read_text()
    finally:
        for pid in (rank0.pid, follower):
            _kill_quietly(pid)  # SIGKILL ends a stopped process too
        rank0.wait(timeout=30)
    # the last heartbeat came up to hang_s / 4 before the stop; silence is checked every 0.2 s
    assert 0.7 * hang_s <= found_at - stopped_at <= hang_s + 5.0


def _exited_at(pid: int, timeout_s: float) -> float:
    """When `pid` exited (a zombie: its stopped parent cannot reap it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            state = "Z"
        if state in ("Z", "X"):
            return time.time()
        time.sleep(0.01)
    raise AssertionError(f"rank {pid} never exited")


def _kill_quietly(pid: int | None) -> None:
    try:
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
