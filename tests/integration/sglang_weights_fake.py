"""SGLang's two weight-sync routes, for CPU tests (gloo), as SGLang's model runner serves them:
`/init_weights_update_group` joins the trainer's group the way `sglang.srt.utils.
init_custom_process_group` does (a tcp:// rendezvous, keys under the group name, a group beside the
default one) at rank `rank_offset`; `/update_weights_from_distributed` receives one broadcast from
rank 0 per announced name, in order, into tensors of the announced dtype and shape, then saves them
to `--out` (safetensors) where SGLang would load them into its model. Replies as SGLang does.

Usage: python tests/integration/sglang_weights_fake.py --out FILE --port-file F
"""

import argparse
import asyncio
from datetime import timedelta

import torch
import torch.distributed as dist
from aiohttp import web
from safetensors.torch import save_file
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

from gyre.common.serve import serve_app

GROUPS: dict[str, dist.ProcessGroup] = {}


def join(body: dict) -> None:
    timeout = timedelta(seconds=120)
    url = f"tcp://{body['master_address']}:{body['master_port']}"
    store, rank, world = next(rendezvous(url, body["rank_offset"], body["world_size"], timeout=timeout))
    store.set_timeout(timeout)
    name = body.get("group_name", "weight_update_group")
    group, _ = _new_process_group_helper(
        world,
        rank,
        [],
        Backend(body.get("backend", "nccl")),
        PrefixStore(name, store),
        group_name=name,
        timeout=timeout,
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world)}
    GROUPS[name] = group


def receive(body: dict, out: str) -> None:
    group = GROUPS[body.get("group_name", "weight_update_group")]
    received = {
        n: torch.empty(s, dtype=getattr(torch, d))
        for n, d, s in zip(body["names"], body["dtypes"], body["shapes"], strict=True)
    }
    for work in [dist.broadcast(t, src=0, group=group, async_op=True) for t in received.values()]:
        work.wait()
    save_file(received, out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--port-file", required=True)
    a = p.parse_args()

    async def init_group(request: web.Request) -> web.Response:
        await asyncio.to_thread(join, await request.json())
        return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async def update(request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("group_name", "weight_update_group") not in GROUPS:
            return web.json_response({"success": False, "message": "call init_weights_update_group first"}, status=400)
        await asyncio.to_thread(receive, body, a.out)
        return web.json_response({"success": True, "message": "Succeeded to update parameter online."})

    app = web.Application(client_max_size=1 << 26)
    app.add_routes(
        [web.post("/init_weights_update_group", init_group), web.post("/update_weights_from_distributed", update)]
    )
    serve_app(app, "127.0.0.1", 0, "sglang-weights-fake", port_file=a.port_file)


if __name__ == "__main__":
    main()
