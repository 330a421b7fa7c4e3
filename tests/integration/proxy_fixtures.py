"""Shared helpers for proxy tests: engines with a scripted policy, a proxy process, admin calls."""

import json
import urllib.error
import urllib.request

from gyre.engines.config import EngineConfig
from gyre.engines.launch import BuiltinEngineProcess
from gyre.models.config import ModelConfig
from gyre.proxy.config import ProxyConfig
from gyre.proxy.main import ProxyProcess

MODEL = ModelConfig(num_layers=1, hidden_size=64, ffn_hidden_size=128, num_attention_heads=2, num_query_groups=1, max_seq_len=32768)
"""The tiny model with a context long enough for Claude Code's prompts (byte tokens)."""


def start_engine(tmp_path, rules: list[dict] | None = None, name: str = "engine", **overrides) -> BuiltinEngineProcess:
    """A builtin engine; `rules` (scripted policy) force what it emits for matching prompts."""
    policy = None
    if rules is not None:
        policy = tmp_path / f"{name}-policy.json"
        policy.write_text(json.dumps({"rules": rules}))
    cfg = EngineConfig(init_seed=0, startup_timeout_s=120, scripted_policy=str(policy) if policy else None, **overrides)
    proc = BuiltinEngineProcess(cfg, MODEL)
    proc.start()
    return proc


def start_proxy(tmp_path, engine_urls: list[str], **overrides) -> ProxyProcess:
    cfg = ProxyConfig(records_dir=str(tmp_path / "records"), engines=engine_urls, model_names=["gyre", "tiny"],
                      health_interval_s=0.5, **overrides)  # fmt: skip
    return ProxyProcess(cfg).start()


def http(url: str, method: str = "GET", body=None, token: str | None = None, headers: dict | None = None, raw: bytes | None = None):
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
    status, body = http(proxy.url + "/admin/executions", "POST", {"execution_id": execution_id}, token=proxy.admin_token)
    assert status == 200, body
    return body["api_key"]
