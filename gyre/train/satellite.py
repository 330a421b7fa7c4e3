"""Entry point of a satellite cell's training role: build the model, join the core, compute micro-steps.

    python -m gyre.train.satellite --model '{...ModelConfig...}' --trainer '{...TrainerConfig...}' [--core ADDR]

Without --core the cell prepares (imports, builds the model, opens its Mooncake endpoint), prints
`ready` and reads the core's address from stdin: a warm cell joins a running step within
milliseconds. On exit it prints one JSON line: micro-steps computed and weight-pull times.
"""

import argparse
import json
import sys

from gyre.models.config import ModelConfig
from gyre.train.config import TrainerConfig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="ModelConfig fields as JSON")
    parser.add_argument("--trainer", required=True, help="TrainerConfig fields as JSON")
    parser.add_argument("--core", help="the core's address (host:port:key); read from stdin if absent")
    parser.add_argument("--max-microsteps", type=int, default=None, help="leave after this many micro-steps")
    args = parser.parse_args(argv)

    import torch

    from gyre.train.elastic import SatelliteCell
    from gyre.train.trainer import Trainer
    from gyre.transfer import TransferEndpoint

    torch.set_num_threads(1)
    trainer = Trainer(ModelConfig(**json.loads(args.model)), TrainerConfig(**json.loads(args.trainer)))
    endpoint = TransferEndpoint()
    address = args.core
    if address is None:
        print("ready", flush=True)
        address = sys.stdin.readline().strip()
    cell = SatelliteCell(trainer, endpoint, address)
    print(f"joined {cell.name}", flush=True)
    computed = cell.serve(args.max_microsteps)
    endpoint.close()
    print(json.dumps({"cell": cell.name, "computed": computed, "pull_s": cell.pull_seconds}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
