"""An engine that reports an error inside its /generate stream (SGLang 0.5.21: HTTP 200, `data:
{"error": ...}`, `data: [DONE]`) after some tokens: the harness gets one clean API error in its
API's format, the call's record keeps the tokens produced (finish abort, the error in its hints),
and the proxy serves the next call. The engine is a stub speaking SGLang's stream."""

import asyncio
import json

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gyre.models.tokenizer import ByteTokenizer
from gyre.proxy.config import ProxyConfig
from gyre.proxy.server import ProxyServer
from gyre.records.io import read_records

TOK = ByteTokenizer()
SAID = TOK.encode("Hello") + [TOK.eos_token_id]
NUM_BEFORE_ERROR = 3
ERROR = {"message": "boom: the engine failed this call", "type": "invalid_request_error", "code": 400}


def _chunk(rid: str, ids: list[int], finish: dict | None) -> bytes:
    meta = {
        "id": rid,
        "finish_reason": finish,
        "prompt_tokens": 5,
        "completion_tokens": len(ids),
        "cached_tokens": 0,
        "weight_version": "0",
        "output_token_logprobs": [[-0.5, t, None] for t in ids],
    }
    if finish:
        meta["weight_versions"] = [{"version": "0", "start": 0, "end": len(ids)}]
    return b"data: " + json.dumps({"text": "", "output_ids": ids, "meta_info": meta}).encode() + b"\n\n"


def make_engine(num_failing: int) -> web.Application:
    """SGLang's routes the proxy calls; its first `num_failing` calls stream 3 tokens then an error."""
    left = [num_failing]

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        fail, left[0] = left[0] > 0, left[0] - 1
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        upto = NUM_BEFORE_ERROR if fail else len(SAID)
        for n in range(1, upto + 1):
            done = None if fail or n < len(SAID) else {"type": "stop", "matched": SAID[-1]}
            await response.write(_chunk(body["rid"], SAID[:n], done))
        if fail:
            await response.write(b"data: " + json.dumps({"error": {**ERROR, "retryable": False}}).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    async def model_info(request: web.Request) -> web.Response:
        return web.json_response({"model_path": "stub", "weight_version": "0", "is_generation": True})

    app = web.Application()
    app.add_routes(
        [web.post("/generate", generate), web.get("/get_model_info", model_info), web.get("/health", model_info)]
    )
    return app


def _events(text: str) -> list[tuple[str | None, object]]:
    """(event name, data: JSON or the literal) of an SSE body."""
    out, name = [], None
    for line in text.splitlines():
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data = line[5:].strip()
            out.append((name, data if data == "[DONE]" else json.loads(data)))
            name = None
    return out


CALLS = {
    "anthropic": ("/v1/messages", {"max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}),
    "chat": ("/v1/chat/completions", {"max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}),
    "responses": ("/v1/responses", {"max_output_tokens": 50, "input": "hi"}),
}


async def _scenario(tmp_path) -> dict:
    async with TestServer(make_engine(num_failing=len(CALLS))) as engine:
        cfg = ProxyConfig(records_dir=str(tmp_path), engines=[str(engine.make_url(""))], admin_token="admin")
        async with TestClient(TestServer(ProxyServer(cfg, TOK).app())) as proxy:
            made = await proxy.post(
                "/admin/executions", json={"execution_id": "x1"}, headers={"Authorization": "Bearer admin"}
            )
            key = (await made.json())["api_key"]
            auth, out = {"Authorization": f"Bearer {key}"}, {}
            for api, (path, body) in [*CALLS.items(), ("after", CALLS["anthropic"])]:
                r = await proxy.post(path, json={"model": "gyre", "stream": True, **body}, headers=auth)
                out[api] = (r.status, _events(await r.text()))
            return out


def test_an_engine_error_mid_stream_is_one_api_error_and_the_call_keeps_its_record(tmp_path):
    out = asyncio.run(_scenario(tmp_path))
    assert all(status == 200 for status, _ in out.values())  # the answers had begun: errors come in-stream
    anthropic, chat, responses = (out[api][1] for api in CALLS)
    errors = [e for e in anthropic if e[0] == "error"]
    assert errors == [
        (
            "error",
            {"type": "error", "error": {"type": "invalid_request_error", "message": errors[0][1]["error"]["message"]}},
        )
    ]
    assert ERROR["message"] in errors[0][1]["error"]["message"] and anthropic[-1] == errors[0]
    assert not any(name == "message_stop" for name, _ in anthropic)
    assert (
        chat[-1] == (None, "[DONE]")
        and list(chat[-2][1]) == ["error"]
        and ERROR["message"] in chat[-2][1]["error"]["message"]
    )
    assert not any(isinstance(d, dict) and d.get("choices", [{}])[0].get("finish_reason") for _, d in chat)
    assert (
        responses[-1][0] == "error"
        and responses[-1][1]["type"] == "error"
        and ERROR["message"] in responses[-1][1]["message"]
    )
    assert not any(name == "response.completed" for name, _ in responses)
    assert any(name == "message_stop" for name, _ in out["after"][1])  # the proxy kept serving

    records, _ = read_records(tmp_path / "x1.jsonl")
    assert [r.seq for r in records] == [0, 1, 2, 3]  # no gap: the failed calls are recorded
    for r in records[:3]:
        assert r.output_ids.tolist() == SAID[:NUM_BEFORE_ERROR] and r.finish_reason == "abort"
        assert r.logprobs.tolist() == [-0.5] * NUM_BEFORE_ERROR and ERROR["message"] in r.hints["error"]["message"]
    assert (
        records[3].output_ids.tolist() == SAID
        and records[3].finish_reason == "stop"
        and "error" not in records[3].hints
    )
