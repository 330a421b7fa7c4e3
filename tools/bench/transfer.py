"""Benchmark: core -> satellite weight pull over Mooncake vs the raw transfer engine, and the phases
of a rollout->train and a train->rollout switch for the tiny model (weights to a real builtin engine).

    PYTHONPATH=. python tools/bench/transfer.py [--hidden 1024 --layers 3 --vocab 16384 --repeats 3]

This process is the core cell; it starts one satellite process (this script with --satellite).
The pull is `SatelliteCell.pull_latest` (one `transfer_sync_read` into the parameters' flat buffer);
"raw" is `TransferEngine.transfer_sync_read` of the same bytes into a separate registered buffer,
in the same run. Prints figures, then one JSON object on the last line.
"""

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time

import torch

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
        rc = endpoint._engine.transfer_sync_read(cell._core_session, raw_buf.data_ptr(), cell._weights_addr, nbytes)
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
    print(json.dumps(out), flush=True)


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


def core(args) -> dict:
    from gyre.engines.client import EngineClient
    from gyre.engines.config import EngineConfig
    from gyre.engines.launch import BuiltinEngineProcess
    from gyre.engines.weights import load_weights
    from gyre.models.checkpoint import save_checkpoint
    from gyre.train.elastic import CoreServer
    from gyre.train.publish import WeightPublisher
    from gyre.train.trainer import Trainer
    from gyre.transfer import TransferEndpoint

    torch.set_num_threads(1)
    endpoint = TransferEndpoint()
    big, tiny = Trainer(_big(args), _CFG), Trainer(TINY, _CFG)
    servers = CoreServer(big, endpoint), CoreServer(tiny, endpoint)
    cmd = [
        sys.executable,
        __file__,
        "--satellite",
        "--big-core",
        servers[0].address,
        "--tiny-core",
        servers[1].address,
        "--hidden",
        str(args.hidden),
        "--layers",
        str(args.layers),
        "--vocab",
        str(args.vocab),
        "--repeats",
        str(args.repeats),
    ]
    sat = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    engine = BuiltinEngineProcess(EngineConfig(startup_timeout_s=300), TINY)
    try:
        engine.start()
        res = {}
        t = threading.Thread(target=lambda: res.update(_step(servers[0], [_batch(big.model_cfg, 0)])))
        t.start(), t.join()
        assert sat.stdout.readline().strip() == "tiny-joined"
        t0 = time.perf_counter()
        res_tiny = _step(servers[1], [_batch(TINY, 1)])
        step_total = time.perf_counter() - t0
        report = json.loads(sat.stdout.readline())
        # train -> rollout: the core's new weights leave for the engines (engine names, on disk here).
        t0 = time.perf_counter()
        named = tiny.engine_weights()
        convert_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        save_checkpoint(os.path.join(args.out_dir, "tiny_weights"), TINY, named)
        publish_s = time.perf_counter() - t0

        async def push():
            async with EngineClient(engine.url, timeout_s=120) as client:
                t0 = time.perf_counter()
                await load_weights(client, WeightPublisher(servers[1], "mooncake", TINY, "", "127.0.0.1").publish())
                return time.perf_counter() - t0, (await client.model_info())["weight_version"]

        push_s, version = asyncio.run(push())
        assert version == tiny.step, version
    finally:
        engine.stop()
        for s in servers:
            s.close()
        sat.wait(timeout=60)
    report |= {
        "switch_to_train/step_with_one_satellite_s": step_total,
        "switch_to_rollout/convert_s": convert_s,
        "switch_to_rollout/publish_disk_s": publish_s,
        "switch_to_rollout/push_to_engine_mooncake_s": push_s,
        "tiny_grad_norm": res_tiny["grad_norm"],
    }
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--satellite", action="store_true")
    p.add_argument("--big-core"), p.add_argument("--tiny-core")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out-dir", default="/tmp/gyre-bench-transfer")
    args = p.parse_args()
    if args.satellite:
        return satellite(args)
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
        json.dumps(
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
