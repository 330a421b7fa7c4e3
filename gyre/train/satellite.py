"""Entry point of a satellite cell's training role: build the model, join the core, compute micro-steps.

    python -m gyre.train.satellite --cell NAME --model '{...ModelConfig...}' --trainer '{...TrainerConfig...}' [--core ADDR]

Without --core the cell prepares (imports, builds the model, opens its Mooncake endpoint), prints
`ready` and reads the core's address from stdin: a warm cell joins a running step within
milliseconds. SIGTERM makes it leave after the micro-step in progress (nothing is redone). On exit
it prints one JSON line: micro-steps computed and weight-pull times.
"""

import argparse
import json
import signal
import sys
import threading

from gyre.models.config import ModelConfig
from gyre.train.config import TrainerConfig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="ModelConfig fields as JSON")
    parser.add_argument("--trainer", required=True, help="TrainerConfig fields as JSON")
    parser.add_argument("--cell", required=True, help="this cell's name (e.g. cell2: the scheduler's cell index)")
    parser.add_argument("--core", help="the core's control address (tcp://... or mpi:...); read from stdin if absent")
    parser.add_argument("--host", default="127.0.0.1", help="interface of this cell's Mooncake endpoint")
    args = parser.parse_args(argv)

    import torch

    from gyre.train.elastic import SatelliteCell
    from gyre.train.trainer import Trainer
    from gyre.transfer import TransferEndpoint

    torch.set_num_threads(1)
    trainer = Trainer(ModelConfig(**json.loads(args.model)), TrainerConfig(**json.loads(args.trainer)))
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
    print(json.dumps({"cell": cell.cell, "computed": computed, "pull_s": cell.pull_seconds}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
