"""Core + satellites: satellites are separate processes with their own Mooncake engines; they join
mid-step while its batches still stream in, pull weights, return gradients; the step equals the
core computing alone. A satellite killed mid-micro-step loses only that micro-step, which another
cell redoes; one told to leave finishes its micro-step first and can serve again later."""

import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from _train_ref import random_batches

from gyre.coordinator.training import StepRecord, Training
from gyre.models.config import ModelConfig
from gyre.train.config import TrainerConfig
from gyre.train.elastic import CoreServer, ElasticError
from gyre.train.satellite import SatelliteCell
from gyre.train.trainer import Trainer
from gyre.transfer import TransferEndpoint

MODEL = ModelConfig(
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=96,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=64,
    max_seq_len=512,
)
CFG = TrainerConfig(lr=1e-3, num_grad_slots=3)
ROOT = Path(__file__).resolve().parents[2]


class Satellite:
    """A warm satellite process: model built, waiting on stdin for the core's address."""

    def __init__(self, log: Path, cfg: TrainerConfig, cell: str, launcher: tuple[str, ...] = ()):
        cmd = [
            *launcher,
            sys.executable,
            "-m",
            "gyre.train.satellite",
            "--cell",
            cell,
            "--model",
            json.dumps(dataclasses.asdict(MODEL)),
            "--trainer",
            json.dumps(dataclasses.asdict(cfg)),
        ]
        self.log = log
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True
        )

    def expect(self, prefix: str, timeout_s: float = 120) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if ready:
                line = self.proc.stdout.readline()
                if line.startswith(prefix):
                    return line.strip()
                if not line:
                    break
        raise AssertionError(f"satellite never said {prefix!r}; log tail: {self.log.read_text()[-1500:]}")

    def join(self, address: str) -> None:
        self.proc.stdin.write(address + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # SIGKILL also ends a stopped (SIGSTOP) process
        self.proc.wait(timeout=30)


@pytest.fixture
def start_satellites(tmp_path):
    torch.set_num_threads(1)
    started = []

    def start(n: int, cfg: TrainerConfig = CFG, launcher: tuple[str, ...] = ()) -> list[Satellite]:
        base = len(started)
        started.extend(
            [Satellite(tmp_path / f"sat{base + i}.log", cfg, f"satellite{base + i + 1}", launcher) for i in range(n)]
        )
        return started[-n:]

    try:
        yield start
    finally:
        for s in started:
            s.stop()


def _wait_for(cond, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.001)


def _run_in_thread(server, batches=(), end=True):
    """Open a step, start run_step in a thread, add `batches` (and end the step if `end`)."""
    out = {}
    server.begin_step()
    t = threading.Thread(target=lambda: out.update(server.run_step()))
    t.start()
    for b in batches:
        server.add_micro_batch(b)
    if end:
        server.end_step()
    return t, out


def _rel_diff(a, b):
    return float((a - b).abs().max() / b.abs().max())


def test_satellites_joining_mid_step_and_one_dying_equal_the_core_alone(start_satellites):
    satellites = start_satellites(2)
    steps = [random_batches(MODEL, 8, 4, seed=11, max_len=64), random_batches(MODEL, 5, 4, seed=12, max_len=400)]
    ref = Trainer(MODEL, CFG, seed=0)  # the core alone (while the satellites start up)
    expected = []
    for batches in steps:
        ref.train_step(batches)
        expected.append(ref.flat.weights.clone())
    for s in satellites:
        s.expect("ready")

    # The core only sums and steps: every micro-step is a satellite's, so the split is all theirs.
    core = Trainer(MODEL, replace(CFG, core_computes_microsteps=False), seed=0)
    server = CoreServer(core, TransferEndpoint())
    try:
        t_begin = time.time()
        thread, first = _run_in_thread(server, steps[0][:3], end=False)  # the rest is still being generated
        satellites[0].join(server.address)
        _wait_for(lambda: len(server.progress()[1]) >= 1, "the first satellite's first micro-step")
        satellites[1].join(server.address)  # joins a step that is already under way
        satellites[1].expect("joined")
        for b in steps[0][3:]:
            server.add_micro_batch(b)
        server.end_step()
        thread.join(timeout=120)
        assert first["microsteps_by/satellite1"] >= 1 and first["microsteps_by/satellite2"] >= 1
        assert [c for _, c, _, _, _, _ in first["microsteps"]].count("satellite1") == first["microsteps_by/satellite1"]
        assert all(seconds > 0 for _, _, seconds, _, _, _ in first["microsteps"])
        assert all(t_begin + seconds <= ended <= time.time() for _, _, seconds, ended, _, _ in first["microsteps"])
        assert _rel_diff(core.flat.weights, expected[0]) <= 1e-6
        assert torch.equal(core.flat.weights, expected[0])  # on CPU it is in fact bitwise

        # Step 2 (both pull the new version): kill satellite2 while it computes; satellite1 redoes it.
        thread, second = _run_in_thread(server, steps[1])
        _wait_for(lambda: "satellite2" in server.progress()[0].values(), "satellite2 to claim a micro-step")
        os.kill(satellites[1].proc.pid, signal.SIGKILL)
        thread.join(timeout=120)
        os.kill(satellites[0].proc.pid, signal.SIGTERM)  # leave (after a micro-step, were it computing one)
        report = json.loads(satellites[0].expect("{"))
    finally:
        server.close()
    assert second["microsteps_redone"] >= 1
    assert second["microsteps_by/satellite1"] + second.get("microsteps_by/satellite2", 0) == 5
    assert torch.equal(core.flat.weights, expected[1])
    assert report["computed"] == first["microsteps_by/satellite1"] + second["microsteps_by/satellite1"]
    assert len(report["pull_s"]) == 2  # one weight pull per version


def test_a_hung_satellite_loses_its_micro_step_after_the_claim_timeout(start_satellites):
    cfg = replace(CFG, claim_timeout_s=1.0)
    (victim,) = start_satellites(1, cfg)
    batches = random_batches(MODEL, 4, 4, seed=13, max_len=400)
    ref = Trainer(MODEL, cfg, seed=0)
    ref.train_step(batches)
    victim.expect("ready")
    core = Trainer(MODEL, cfg, seed=0)
    server = CoreServer(core, TransferEndpoint())
    try:
        thread, metrics = _run_in_thread(server, batches)
        victim.join(server.address)
        _wait_for(lambda: "satellite1" in server.progress()[0].values(), "the satellite to claim a micro-step")
        os.kill(victim.proc.pid, signal.SIGSTOP)  # hung: alive, connection open, never answers
        thread.join(timeout=120)
    finally:
        server.close()
    assert metrics["microsteps_redone"] >= 1 and metrics["microsteps_by/core"] >= 3
    assert torch.equal(core.flat.weights, ref.flat.weights)


def test_a_satellite_told_to_leave_finishes_its_micro_step_and_serves_again_later():
    """In-process satellite (its own trainer and Mooncake endpoint), the core only sums: stop -> it
    finishes the micro-step it holds (nothing redone) and says Leave; later serve() calls rejoin
    without rebuilding anything; a pull at any time gets the core's current version."""
    steps = [random_batches(MODEL, 3, 4, seed=21, max_len=200), random_batches(MODEL, 2, 4, seed=22, max_len=200)]
    ref = Trainer(MODEL, CFG, seed=0)
    for batches in steps:
        ref.train_step(batches)
    core = Trainer(MODEL, replace(CFG, core_computes_microsteps=False), seed=0)
    server = CoreServer(core, TransferEndpoint())
    sat_endpoint = TransferEndpoint()

    def serve_in_thread(stop):
        served = []
        worker = threading.Thread(target=lambda: served.append(sat.serve(stop)))
        worker.start()
        return worker, served

    try:
        sat = SatelliteCell(Trainer(MODEL, CFG, seed=5), sat_endpoint, server.address, "cell2")
        assert sat.pull_latest()[0] == 0 and torch.equal(sat.trainer.flat.weights, core.flat.weights)
        thread, first = _run_in_thread(server, steps[0])
        stop = threading.Event()
        worker, served = serve_in_thread(stop)
        _wait_for(lambda: "cell2" in server.progress()[0].values(), "cell2 to claim a micro-step")
        stop.set()  # leave after the current micro-step
        worker.join(timeout=120)
        assert served == [1]
        # done, nothing held (the core books the result its own thread receives: it may lag the satellite)
        _wait_for(lambda: server.progress() == ({}, {0: "cell2"}), "the core to book cell2's micro-step")
        worker, served = serve_in_thread(threading.Event())  # rejoin: the step is not finished
        thread.join(timeout=120)
        assert first["microsteps_redone"] == 0 and first["microsteps_by/cell2"] == 3

        thread, second = _run_in_thread(server, steps[1])  # the satellite is still serving
        thread.join(timeout=120)
        assert second["microsteps_by/cell2"] == 2
        version, seconds = sat.pull_latest()  # between steps, outside any claim
        assert version == 2 == core.step and seconds > 0
        assert torch.equal(sat.trainer.flat.weights, core.flat.weights)
    finally:
        server.close()
        worker.join(timeout=60)
        sat_endpoint.close()
    assert torch.equal(core.flat.weights, ref.flat.weights)
    assert served == [2 + 2]  # the rest of step 1 and all of step 2; the core closed: serve returned


def test_each_micro_step_says_when_it_ended_and_the_cores_never_overlap():
    """A cell's busy time is [ended - seconds, ended] of its micro-steps (gyre.metrics.state): the
    core computes them one after another, so its spans are disjoint and fall within the step."""
    core = Trainer(MODEL, CFG, seed=0)
    server = CoreServer(core, TransferEndpoint())
    try:
        t_begin = time.time()
        thread, out = _run_in_thread(server, random_batches(MODEL, 3, 2, seed=3))
        thread.join(timeout=120)
        assert [cell for _, cell, _, _, _, _ in out["microsteps"]] == ["core"] * 3
        spans = sorted((ended - seconds, ended) for _, _, seconds, ended, _, _ in out["microsteps"])
        assert t_begin <= spans[0][0] and spans[-1][1] <= time.time()
        assert all(a[1] <= b[0] + 1e-3 for a, b in zip(spans, spans[1:]))
    finally:
        server.close()


def test_a_satellite_of_another_layout_is_refused_naming_both():
    """Satellite rank r pulls from core rank r: a cell of another (ranks, tensor parallel) layout
    would read shards of other shapes, so the core refuses it before any byte moves."""
    from gyre.control import messages as m
    from gyre.control.transport import connect

    core = Trainer(MODEL, CFG, seed=0)
    server = CoreServer(core, TransferEndpoint())
    ch = connect(server.address)
    try:
        reply = ch.request(m.Join("cell2", core.flat.signature(), ranks=2, tp=2), timeout_s=30)
    finally:
        ch.close()
        server.close()
    assert isinstance(reply, m.Refused) and "(2, 2) differs from the core's (1, 1)" in reply.reason


def test_step_api_misuse_is_a_clear_error():
    core = Trainer(MODEL, CFG, seed=0)
    server = CoreServer(core, TransferEndpoint())
    try:
        with pytest.raises(ElasticError, match="begin_step"):
            server.add_micro_batch(random_batches(MODEL, 1, 2, seed=1)[0])
        server.begin_step()
        with pytest.raises(ElasticError, match="still open"):
            server.begin_step()
        server.abort_step()
        assert core.step == 0  # nothing was applied; a new step can open
        with pytest.raises(ElasticError, match="core is at step 0"):
            server.begin_step(1)
        server.begin_step(0)
        weights = core.flat.weights.clone()
        server.end_step()  # e.g. every group of the step was excluded: skipped, the version moves on
        assert server.run_step() == {"skipped": 1} and core.step == 1 and torch.equal(core.flat.weights, weights)
        server.begin_step()
        server.add_micro_batch(random_batches(MODEL, 1, 2, seed=1)[0])
        server.end_step()
        with pytest.raises(ElasticError, match="already ended"):
            server.add_micro_batch(random_batches(MODEL, 1, 2, seed=2)[0])
        assert server.run_step()["microsteps_by/core"] == 1 and core.step == 2
    finally:
        server.close()


def test_over_the_mpi_control_transport_a_satellite_trains_the_same_step(start_satellites, tmp_path):
    """The same core/satellite exchange with control messages on MPI (the satellite under mpiexec:
    two MPICH singletons cannot connect); bytes still move over Mooncake."""
    pytest.importorskip("mpi4py")
    from gyre.control.transport import listen

    cfg = replace(CFG, core_computes_microsteps=False)
    (sat,) = start_satellites(1, cfg, launcher=(str(Path(sys.executable).with_name("mpiexec")), "-n", "1"))
    batches = random_batches(MODEL, 3, 4, seed=31, max_len=64)
    ref = Trainer(MODEL, cfg, seed=0)
    ref.train_step(batches)
    core = Trainer(MODEL, cfg, seed=0)
    server = CoreServer(core, TransferEndpoint(), listener=listen("mpi", port_file=str(tmp_path / "core.port")))
    try:
        thread, metrics = _run_in_thread(server, batches)
        sat.expect("ready")
        sat.join(server.address)
        thread.join(timeout=120)
        os.kill(sat.proc.pid, signal.SIGTERM)  # mpiexec forwards it: the satellite leaves
        report = json.loads(sat.expect("{"))
    finally:
        server.close()
    assert metrics["microsteps_by/satellite1"] == 3 == report["computed"]
    assert torch.equal(core.flat.weights, ref.flat.weights)


def test_micro_batches_keep_their_ids_from_the_core_to_the_coordinators_steps():
    """The core reports (step, group, k) ids: a screened-out one at once, trained ones as they are
    folded; the coordinator retires a group from the ready work only once all its ids are reported."""
    from gyre.control.messages import StepProgress
    from gyre.train.batch import BatchError
    from gyre.trajectory.config import TrajectoryConfig

    core = Trainer(MODEL, CFG, seed=0)
    server = CoreServer(core, TransferEndpoint())
    good = random_batches(MODEL, 3, 2, seed=1)
    empty = replace(good[0], loss_weights=torch.zeros_like(good[0].loss_weights))
    try:
        server.begin_step(0)
        server.add_micro_batch(good[0], (0, 4, 0))
        with pytest.raises(BatchError, match="no trainable sequence"):
            server.add_micro_batch(empty, (0, 4, 1))
        server.add_micro_batch(good[1], (0, 7, 0))
        assert server.done_ids() == [(0, 4, 1)]  # screened: done at once
        server.add_micro_batch(good[2], (0, 7, 1))
        server.end_step()
        out = server.run_step()
    finally:
        server.close()
    assert [t[0] for t in out["microsteps"]] == [(0, 4, 0), (0, 7, 0), (0, 7, 1)]
    assert [t[4] for t in out["microsteps"]] == [b.num_tokens for b in good]

    train = Training(
        groups_per_step=2, staleness=0, trajectory=TrajectoryConfig(), max_tokens=0, version=0, train_tok_s=1.0
    )
    rec = train.steps[0] = StepRecord(0, untrained={gi: {(0, gi, 0), (0, gi, 1)} for gi in (4, 7)})
    train.on_progress(StepProgress(0, [(0, 4, 1), (0, 7, 0)]))
    assert set(rec.untrained) == {4, 7}  # neither group has all its ids yet
    train.on_progress(StepProgress(0, [(0, 4, 1), (0, 7, 0), (0, 4, 0)]))
    assert set(rec.untrained) == {7}


def test_a_satellite_that_moves_its_trainer_off_the_device_between_steps_trains_bit_for_bit():
    """Offload on every switch (gyre.train.shard.offload_trainer / onload_trainer): the state leaves
    its storage (nothing left where it was), comes back at new addresses, registered again, and the
    steps the satellite then computes give the core alone's weights bit for bit."""
    from gyre.train.shard import offload_trainer, onload_trainer

    steps = [random_batches(MODEL, 3, 4, seed=31, max_len=200), random_batches(MODEL, 2, 4, seed=32, max_len=200)]
    ref = Trainer(MODEL, CFG, seed=0)
    for batches in steps:
        ref.train_step(batches)
    core = Trainer(MODEL, replace(CFG, core_computes_microsteps=False), seed=0)
    server = CoreServer(core, TransferEndpoint())
    sat_endpoint = TransferEndpoint()
    try:
        sat = SatelliteCell(Trainer(MODEL, CFG, seed=5), sat_endpoint, server.address, "cell2")
        for batches in steps:
            sat.ranks.run(offload_trainer)  # the cell served meanwhile
            weights = sat.trainer.flat.weights
            assert weights.untyped_storage().nbytes() == 0 == sat.trainer.grad.untyped_storage().nbytes()
            sat.ranks.run(onload_trainer)  # back to train: pull, then compute
            sat.pull_latest()
            assert torch.equal(sat.trainer.flat.weights, core.flat.weights)
            thread, _ = _run_in_thread(server, batches)
            stop = threading.Event()
            worker = threading.Thread(target=sat.serve, args=(stop,))
            worker.start()
            thread.join(timeout=120)
            stop.set()
            worker.join(timeout=120)
    finally:
        server.close()
        sat_endpoint.close()
    assert torch.equal(core.flat.weights, ref.flat.weights)


def test_offload_moves_the_optimizer_state_too_and_brings_it_back_bit_for_bit():
    """A trainer that has stepped (Adam state) offloads and onloads; the next step equals one that never moved."""
    batches = [random_batches(MODEL, 2, 3, seed=s, max_len=120) for s in (41, 42)]
    moved, still = Trainer(MODEL, CFG, seed=0), Trainer(MODEL, CFG, seed=0)
    for tr in (moved, still):
        tr.train_step(batches[0])
    moved.offload()
    assert moved.offloaded and moved.flat.weights.untyped_storage().nbytes() == 0
    assert all(t.untyped_storage().nbytes() == 0 for s in moved.local_optimizer.state.values() for t in s.values())
    moved.onload()
    for tr in (moved, still):
        tr.train_step(batches[1])
    assert torch.equal(moved.flat.weights, still.flat.weights)
