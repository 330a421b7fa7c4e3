"""Benchmark: core -> satellite weight pull over Mooncake vs the raw transfer engine, and the phases
of a rollout->train and a train->rollout switch for the tiny model (weights to a real builtin engine).

    PYTHONPATH=. python tools/bench/transfer.py [--hidden 1024 --layers 3 --vocab 16384 --repeats 5] [--smoke]

This process is the core cell; it starts one satellite process (this script with --satellite).
The pull is `SatelliteCell.pull_latest` (one `transfer_sync_read` into the parameters' flat buffer);
"raw" is `TransferEngine.transfer_sync_read` of the same bytes into a separate registered buffer,
in the same run. Prints figures, then one JSON object on the last line.

With --smoke (the test suite's run, tests/integration/test_bench_smoke.py): a 64-wide one-layer model
and one pull, so every phase above runs in seconds; its figures mean nothing.
"""

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import threading
import time

import torch

from gyre.common import jsonio
from gyre.models.config import ModelConfig
from gyre.train.config import TrainerConfig

TINY = ModelConfig()  # conf/model/tiny.yaml
_CFG = TrainerConfig(lr=1e-5, num_grad_slots=1, core_computes_microsteps=False)


def _big(args) -> ModelConfig:
    return ModelConfig(
        name="bench",
        num_layers=args.layers,
        hidden_size=args.hidden,
        ffn_hidden_size=args.hidden * 11 // 4,
        num_attention_heads=16,
        num_query_groups=4,
        vocab_size=args.vocab,
        max_seq_len=512,
    )


def _batch(cfg: ModelConfig, seed: int):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "unit"))
    from _train_ref import random_batches  # synthetic packed samples (the processor's format)

    return random_batches(cfg, 1, 4, seed=seed, max_len=64)[0]


def satellite(args) -> None:
    """The satellite side: join each core, time the phases, print one JSON line."""
    from gyre.train.satellite import SatelliteCell
    from gyre.train.trainer import Trainer
    from gyre.transfer import TransferEndpoint

    torch.set_num_threads(1)
    out = {}
    endpoint = TransferEndpoint()
    big = Trainer(_big(args), _CFG)
    cell = SatelliteCell(big, endpoint, args.big_core, "bench-big")
    raw_buf = torch.zeros_like(big.flat.weights)  # touched, like the parameters: no page faults timed
    endpoint.register(raw_buf)
    nbytes = raw_buf.numel() * 4
    pulls, raws = [], []
    for _ in range(args.repeats):
        cell.pull_latest()
        pulls.append(cell.pull_seconds[-1])
        t0 = time.perf_counter()
        session, weights_addr, _ = cell.ranks.state.peer  # the core rank's Mooncake session and weights
        rc = endpoint._engine.transfer_sync_read(session, raw_buf.data_ptr(), weights_addr, nbytes)
        raws.append(time.perf_counter() - t0)
        assert rc == 0, f"raw read returned {rc}"
    assert torch.equal(raw_buf, big.flat.weights)
    _serve_one(cell)  # pull (new cell version) + micro-step + gradient write of the full size
    out["big/microstep_and_grad_write_s"] = cell.microstep_seconds[0]
    out |= {"bytes": nbytes, "pull_s": pulls, "raw_s": raws}
    del big, raw_buf

    tiny = Trainer(TINY, _CFG)
    t0 = time.perf_counter()
    cell = SatelliteCell(tiny, endpoint, args.tiny_core, "bench-tiny")
    out["switch_to_train/join_s"] = time.perf_counter() - t0
    print("tiny-joined", flush=True)
    _serve_one(cell)
    out["switch_to_train/pull_s"] = cell.pull_seconds[0]
    out["switch_to_train/microstep_and_grad_write_s"] = cell.microstep_seconds[0]
    endpoint.close()
    print(jsonio.dumps(out), flush=True)


def _serve_one(cell) -> None:
    """Serve until one micro-step is computed, then leave."""
    stop, start = threading.Event(), cell.num_computed
    worker = threading.Thread(target=cell.serve, args=(stop,))
    worker.start()
    while cell.num_computed == start and worker.is_alive():
        time.sleep(0.001)
    stop.set()
    worker.join()


def _step(server, batches) -> dict:
    server.begin_step()
    for b in batches:
        server.add_micro_batch(b)
    server.end_step()
    return server.run_step()


def _start_satellite(args, servers) -> tuple[subprocess.Popen, str]:
    """The satellite process (its stderr in out_dir/satellite.log, shown if it fails)."""
    cmd = [sys.executable, __file__, "--satellite", "--big-core", servers[0].address, "--tiny-core", servers[1].address]
    cmd += ["--hidden", str(args.hidden), "--layers", str(args.layers), "--vocab", str(args.vocab)]
    cmd += ["--repeats", str(args.repeats)]
    log = os.path.join(args.out_dir, "satellite.log")
    with open(log, "w") as err:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env), log


def _tail(log: str) -> str:
    with open(log) as f:
        return f.read()[-3000:]


def _step_with(sat: subprocess.Popen, log: str, server, batches) -> tuple[dict, float]:
    """One step whose micro-step the satellite computes: (its result, its seconds). A satellite
    that fails first fails the run with its log: the core would wait for that work forever."""
    out: dict = {}

    def run() -> None:
        t0 = time.perf_counter()
        try:
            out["result"] = _step(server, batches)
        except BaseException as e:  # re-raised in the caller's thread
            out["error"] = e
        out["seconds"] = time.perf_counter() - t0

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(timeout=0.2)
        if worker.is_alive() and sat.poll() not in (None, 0):  # 0: it did its part and left
            raise RuntimeError(f"the satellite failed ({sat.returncode}) during the step:\n{_tail(log)}")
    if "error" in out:
        raise out["error"]
    return out["result"], out["seconds"]


def _switch_to_rollout(args, engine, server, tiny) -> dict:
    """train -> rollout: the core's new weights leave for the engines (engine names, on disk here)."""
    from gyre.engines.client import EngineClient
    from gyre.engines.weights import load_weights
    from gyre.models.checkpoint import save_checkpoint
    from gyre.train.publish import WeightPublisher

    t0 = time.perf_counter()
    named = tiny.engine_weights()
    convert_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    save_checkpoint(os.path.join(args.out_dir, "tiny_weights"), TINY, named)
    publish_s = time.perf_counter() - t0

    async def push():
        async with EngineClient(engine.url, timeout_s=120) as client:
            t0 = time.perf_counter()
            await load_weights(client, WeightPublisher(server, "mooncake", TINY, "", "127.0.0.1").publish())
            return time.perf_counter() - t0, (await client.model_info())["weight_version"]

    push_s, version = asyncio.run(push())
    assert version == tiny.step, version
    return {
        "switch_to_rollout/convert_s": convert_s,
        "switch_to_rollout/publish_disk_s": publish_s,
        "switch_to_rollout/push_to_engine_mooncake_s": push_s,
    }


def core(args) -> dict:
    from gyre.engines.config import EngineConfig
    from gyre.engines.launch import BuiltinEngineProcess
    from gyre.train.elastic import CoreServer
    from gyre.train.trainer import Trainer
    from gyre.transfer import TransferEndpoint

    torch.set_num_threads(1)
    endpoint = TransferEndpoint()
    big, tiny = Trainer(_big(args), _CFG), Trainer(TINY, _CFG)
    servers = CoreServer(big, endpoint), CoreServer(tiny, endpoint)
    sat, log = _start_satellite(args, servers)
    engine = BuiltinEngineProcess(EngineConfig(startup_timeout_s=300), TINY)
    try:
        engine.start()
        _step_with(sat, log, servers[0], [_batch(big.model_cfg, 0)])
        assert sat.stdout.readline().strip() == "tiny-joined", _tail(log)
        res_tiny, step_s = _step_with(sat, log, servers[1], [_batch(TINY, 1)])
        report = jsonio.loads(sat.stdout.readline())
        report |= _switch_to_rollout(args, engine, servers[1], tiny)
    finally:
        engine.stop()
        for s in servers:
            s.close()
        try:
            sat.wait(timeout=60)
        except subprocess.TimeoutExpired:
            sat.kill()
            sat.wait()
    return report | {"switch_to_train/step_with_one_satellite_s": step_s, "tiny_grad_norm": res_tiny["grad_norm"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--satellite", action="store_true")
    p.add_argument("--big-core"), p.add_argument("--tiny-core")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out-dir", default=None, help="satellite log and weights (default: a temporary directory)")
    p.add_argument("--smoke", action="store_true", help="smallest sizes, seconds (the test suite's run)")
    args = p.parse_args()
    if args.smoke:
        args.hidden, args.layers, args.vocab, args.repeats = 64, 1, 256, 1
    if args.satellite:
        return satellite(args)
    with tempfile.TemporaryDirectory(prefix="gyre-bench-transfer-") as tmp:
        args.out_dir = args.out_dir or tmp
        os.makedirs(args.out_dir, exist_ok=True)
        r = core(args)
    gb = r["bytes"] / 1e9
    pull_gbps, raw_gbps = gb / min(r["pull_s"]), gb / min(r["raw_s"])
    print(f"weights: {r['bytes'] / 2**20:.1f} MiB fp32")
    print(
        f"pull (SatelliteCell.pull): best {min(r['pull_s']):.3f} s = {pull_gbps:.2f} GB/s   all "
        f"{[round(x, 3) for x in r['pull_s']]}"
    )
    print(
        f"raw transfer_sync_read:    best {min(r['raw_s']):.3f} s = {raw_gbps:.2f} GB/s   all "
        f"{[round(x, 3) for x in r['raw_s']]}"
    )
    print(f"pull / raw = {pull_gbps / raw_gbps:.1%}")
    phases = {k: round(v, 4) for k, v in r.items() if "/" in k}
    for k, v in phases.items():
        print(f"{k:48s} {v:.4f} s")
    print(
        jsonio.dumps(
            {
                "bytes": r["bytes"],
                "pull_gbps": round(pull_gbps, 3),
                "raw_gbps": round(raw_gbps, 3),
                "pull_over_raw": round(pull_gbps / raw_gbps, 3),
            }
            | phases
        )
    )


if __name__ == "__main__":
    main()
