"""An engine that takes its weight update late, for tests of the core's weight sender: SGLang's two
weight routes as the sender calls them, in a process of its own (a weight group's ranks cannot
share one process under one group name). /update_weights_from_distributed receives only after
POST /go, as SGLang's update waits for its write lock while a call is in flight; GET /asked says
whether the update's request arrived. Its answer carries the sum of each received tensor.

    python tests/unit/_late_engine.py     # prints its port on the first line of stdout
"""

import asyncio

import torch
import torch.distributed as dist
from aiohttp import web

from gyre.common.weight_group import join_weight_group


class LateEngine:
    def __init__(self):
        self.asked, self.go = asyncio.Event(), asyncio.Event()
        self.group: dist.ProcessGroup | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.add_routes(
            [
                web.post("/init_weights_update_group", self.init_group),
                web.post("/update_weights_from_distributed", self.update),
                web.get("/asked", self.is_asked),
                web.post("/go", self.let_go),
            ]
        )
        return app

    async def init_group(self, request: web.Request) -> web.Response:
        b = await request.json()
        args = (b["master_address"], int(b["master_port"]), int(b["rank_offset"]), int(b["world_size"]))
        self.group = await asyncio.to_thread(join_weight_group, *args, b["group_name"], b["backend"])
        return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async def update(self, request: web.Request) -> web.Response:
        b = await request.json()
        self.asked.set()
        await self.go.wait()

        def receive() -> dict[str, float]:
            shapes = zip(b["names"], b["dtypes"], b["shapes"], strict=True)
            out = {n: torch.empty(s, dtype=getattr(torch, d)) for n, d, s in shapes}
            for work in [dist.broadcast(t, group=self.group, group_src=0, async_op=True) for t in out.values()]:
                work.wait()
            return {n: float(t.double().sum()) for n, t in out.items()}

        sums = await asyncio.to_thread(receive)
        message = f"Weight version updated to {b['weight_version']}."
        return web.json_response({"success": True, "message": message, "sums": sums})

    async def is_asked(self, request: web.Request) -> web.Response:
        return web.json_response(self.asked.is_set())

    async def let_go(self, request: web.Request) -> web.Response:
        self.go.set()
        return web.json_response(True)


async def main() -> None:
    runner = web.AppRunner(LateEngine().app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    print(runner.addresses[0][1], flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())
