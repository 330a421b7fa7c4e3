"""Shared helpers for proxy tests: engines with a scripted policy, a proxy process, admin calls."""

import json
import urllib.error
import urllib.request

from gyre.engines.config import EngineConfig
from gyre.engines.launch import BuiltinEngineProcess
from gyre.models.config import ModelConfig
from gyre.proxy.config import ProxyConfig
from gyre.proxy.main import ProxyProcess

MODEL = ModelConfig(
    num_layers=1, hidden_size=64, ffn_hidden_size=128, num_attention_heads=2, num_query_groups=1, max_seq_len=32768
)
"""The tiny model with a context long enough for Claude Code's prompts (byte tokens)."""


def start_engine(
    tmp_path, rules: list[dict] | None = None, name: str = "engine", model: ModelConfig = MODEL, **overrides
) -> BuiltinEngineProcess:
    """A builtin engine; `rules` (scripted policy) force what it emits for matching prompts."""
    policy = None
    if rules is not None:
        policy = tmp_path / f"{name}-policy.json"
        policy.write_text(json.dumps({"rules": rules}))
    cfg = EngineConfig(init_seed=0, startup_timeout_s=120, scripted_policy=str(policy) if policy else None, **overrides)
    proc = BuiltinEngineProcess(cfg, model)
    proc.start()
    return proc


def start_proxy(tmp_path, engine_urls: list[str], **overrides) -> ProxyProcess:
    cfg = ProxyConfig(
        records_dir=str(tmp_path / "records"),
        engines=engine_urls,
        model_names=["gyre", "tiny"],
        health_interval_s=0.5,
        **overrides,
    )
    return ProxyProcess(cfg).start()


def http(
    url: str,
    method: str = "GET",
    body=None,
    token: str | None = None,
    headers: dict | None = None,
    raw: bytes | None = None,
):
    """(status, parsed JSON or text) of one request; never raises on HTTP errors."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    h = {"Content-Type": "application/json", **(headers or {})}
    if token:
        h["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=data, method=method, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def new_execution(proxy: ProxyProcess, execution_id: str) -> str:
    status, body = http(
        proxy.url + "/admin/executions", "POST", {"execution_id": execution_id}, token=proxy.admin_token
    )
    assert status == 200, body
    return body["api_key"]


async def anthropic_call(session, url: str, key: str, body: dict) -> dict:
    """One /v1/messages call as a harness makes it; a streamed answer is reassembled into a Message.

    Raises:
        AssertionError: on an HTTP error, an `error` event, or a stream without message_stop.
    """
    async with session.post(url + "/v1/messages?beta=true", json=body, headers={"x-api-key": key}) as r:
        if not body.get("stream"):
            out = await r.json()
            assert r.status == 200, out
            return out
        assert r.status == 200, await r.text()
        msg, blocks, event = None, {}, None
        async for raw in r.content:
            line = raw.decode().rstrip("\n")
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data = json.loads(line[5:])
                assert event != "error", data
                if data["type"] == "message_start":
                    msg = data["message"]
                elif data["type"] == "content_block_start":
                    blocks[data["index"]] = dict(data["content_block"], _json="")
                elif data["type"] == "content_block_delta":
                    d, b = data["delta"], blocks[data["index"]]
                    if d["type"] == "text_delta":
                        b["text"] += d["text"]
                    else:
                        b["_json"] += d["partial_json"]
                        b["_num_deltas"] = b.get("_num_deltas", 0) + 1
                elif data["type"] == "message_delta":
                    msg.update(data["delta"])
                    msg["usage"] = data["usage"]
                elif data["type"] == "message_stop":
                    msg["num_input_json_deltas"] = sum(b.pop("_num_deltas", 0) for b in blocks.values())
                    msg["content"] = [_close_block(blocks[i]) for i in sorted(blocks)]
                    return msg
        raise AssertionError("stream ended without message_stop")


def _close_block(b: dict) -> dict:
    raw = b.pop("_json")
    if b["type"] == "tool_use":
        b["input"] = json.loads(raw) if raw else {}
    return b


async def openai_call(session, url: str, key: str, body: dict) -> dict:
    """One /v1/chat/completions call (streamed answers reassembled into one message)."""
    async with session.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        if not body.get("stream"):
            out = await r.json()
            assert r.status == 200, out
            return out["choices"][0]
        assert r.status == 200, await r.text()
        msg, finish = {"role": "assistant", "content": "", "tool_calls": []}, None
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            data = json.loads(line[5:])
            assert "error" not in data, data
            for ch in data["choices"]:
                msg["content"] += ch["delta"].get("content") or ""
                for tc in ch["delta"].get("tool_calls") or []:  # deltas of one call share its index
                    if tc["index"] == len(msg["tool_calls"]):
                        msg["tool_calls"].append(
                            {
                                "id": tc["id"],
                                "type": "function",
                                "function": {"name": tc["function"]["name"], "arguments": ""},
                            }
                        )
                    msg["tool_calls"][tc["index"]]["function"]["arguments"] += tc["function"].get("arguments") or ""
                    msg["num_argument_deltas"] = msg.get("num_argument_deltas", 0) + bool(
                        tc["function"].get("arguments")
                    )
                finish = ch["finish_reason"] or finish
        assert finish is not None, "stream ended without a finish_reason"
        return {"message": msg, "finish_reason": finish}
