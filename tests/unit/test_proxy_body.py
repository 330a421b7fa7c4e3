"""The proxy reads a request body whole, in one copy, within its size limit (`_read_body`)."""

import asyncio

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gyre.proxy.chat import ApiError
from gyre.proxy.server import _read_body

LIMIT = 1 << 20


async def _answer(request: web.Request) -> web.Response:
    try:
        body = await _read_body(request)
    except ApiError as e:
        return web.json_response({"kind": e.kind}, status=e.status)
    return web.Response(body=body)


async def _post(data) -> tuple[int, bytes]:
    app = web.Application(client_max_size=LIMIT)
    app["max_body"] = LIMIT
    app.router.add_post("/", _answer)
    async with TestClient(TestServer(app)) as client:
        r = await client.post("/", data=data)
        return r.status, await r.read()


def _chunks(data: bytes, n: int):
    async def gen():  # no length: the client sends a chunked body
        for i in range(0, len(data), n):
            yield data[i : i + n]

    return gen()


BODY = bytes(range(256)) * (LIMIT // 256)  # exactly the limit


@pytest.mark.parametrize(
    "case_id, data, expect",
    [
        ("whole-at-the-limit", lambda: BODY, BODY),
        ("chunked-at-the-limit", lambda: _chunks(BODY, 70_001), BODY),
        ("empty", lambda: b"", b""),
        ("length-over-the-limit", lambda: BODY + b"x", None),
        ("chunked-over-the-limit", lambda: _chunks(BODY + b"x", 70_001), None),
    ],
)
def test_body_read_whole_or_refused_past_the_limit(case_id, data, expect):
    status, out = asyncio.run(_post(data()))
    assert (status, out) == ((200, expect) if expect is not None else (413, b'{"kind": "too_large"}')), case_id
