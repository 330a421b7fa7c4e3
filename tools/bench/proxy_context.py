"""Proxy CPU per call at long contexts (10K to 2M tokens), against floors measured in the same run.

A harness re-sends its whole conversation on every call, so whatever the proxy does per call in
proportion to the context is paid hundreds of times per execution. This drives Claude Code-shaped
conversations (a system prompt with tools, then tool_use / tool_result turns, each call adding one
tool result of `--new-tokens` tokens of project text, streamed answers) through one proxy process
against an engine that answers instantly (a tiny SGLang-contract server in its own process that
reads the request and emits one fixed tool call), and reads the proxy process's own CPU time from
/proc (user + system, all threads: load on the machine does not move it); its idle CPU, measured
first, is subtracted. Side by side, in this process:
  floor_ms      parsing the same request body once (gyre.common.jsonio: orjson)
  floor_tok_ms  that plus tokenizing only the call's new text once (the tokenizer in use)
Each size starts an execution whose history already reaches the size (its first call renders it
all and is not measured), then measures `--calls` calls. With the byte tokenizer (one token per
byte) and with a byte-level BPE trained here on the project's own text with HF `tokenizers`,
served through `gyre.models.tokenizer.HFTokenizer` (a model directory with a Qwen2.5-style chat
template), so `bpe_cpu_ms_per_call` is what a real tokenizer costs.
Throughput: `--workers` proxy worker processes (executions pinned to workers, engines shared),
`--sessions` sessions of `--throughput-tokens` tokens making calls concurrently: calls/s.

Last line: one JSON object {"sizes": {"10000": {"cpu_ms_per_call", "floor_ms", "bpe_cpu_ms_per_call",
"floor_tok_ms", ...}, ...}, "calls_per_s": {"1": ..., "2": ..., "4": ...}}.

Usage: PYTHONPATH=. python tools/bench/proxy_context.py [--sizes 10000,100000,200000,1000000,2000000]
           [--calls 4] [--new-tokens 1000] [--no-bpe] [--workers 1,2,4] [--sessions 8]
       PYTHONPATH=. python tools/bench/proxy_context.py --smoke   (the test suite's run: both tokenizers
           at 10K tokens, one call of 100 new tokens, 2 workers for 2 sessions)
"""

import argparse
import asyncio
import glob
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import psutil

from gyre.common import jsonio
from gyre.common.run_paths import RunPaths
from gyre.common.serve import ChildServer, serve_app
from gyre.common.sse import open_stream, send_events
from gyre.models.tokenizer import SPECIAL_TOKENS, ByteTokenizer, HFTokenizer
from gyre.proxy.config import ProxyConfig

ROOT = Path(__file__).resolve().parents[2]
TOOL_CALL = '<tool_call>\n{"name": "Read", "arguments": {"file_path": "/repo/notes.txt"}}\n</tool_call>'
TOOL_NAMES = (
    "Bash",
    "Read",
    "Edit",
    "Write",
    "Glob",
    "Grep",
    "Agent",
    "TodoWrite",
    "WebFetch",
    "NotebookEdit",
    "Task",
    "LS",
)
QWEN_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    '{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with '
    'function signatures within <tools></tools> XML tags:\\n<tools>" }}{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}'
    '{%- endfor %}{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within '
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}'
    "\\n</tool_call><|im_end|>\\n\" }}{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}{%- if message.content %}"
    "{{- '\\n' + message.content }}{%- endif %}{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}{{- tool_call.arguments | tojson }}'
    "{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen2.5's chat template (the Jinja HF ships with its models), for the BPE model directory."""


def project_text() -> str:
    files = sorted(glob.glob(str(ROOT / "gyre/**/*.py"), recursive=True) + glob.glob(str(ROOT / "*.md")))
    return "\n".join(Path(f).read_text() for f in files)


def make_bpe_model_dir(path: Path, vocab_size: int = 8192) -> Path:
    """A byte-level BPE trained on the project's text, saved as an HF model directory (tokenizer
    files and a Qwen2.5-style chat template) that `HFTokenizer` loads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(project_text().split("\n\n"), trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "chat_template": QWEN_TEMPLATE,
        "model_max_length": 1 << 30,
    }
    (path / "tokenizer_config.json").write_text(jsonio.dumps(config))
    return path


# --- the instant engine (its own process) ---------------------------------------------------------
def serve_instant_engine(output_ids: list[int], port_file: str) -> None:
    """/generate reads the request and answers `output_ids` at once (SGLang's fields)."""
    from aiohttp import web

    async def generate(request: web.Request) -> web.StreamResponse:
        body = jsonio.loads(await request.read())
        meta = {
            "id": body.get("rid"),
            "finish_reason": {"type": "stop"},
            "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": len(output_ids),
            "cached_tokens": 0,
            "weight_version": "0",
            "output_token_logprobs": [[-0.1, i, None] for i in output_ids],
        }
        out = {"text": "", "output_ids": output_ids, "meta_info": meta}
        if not body.get("stream"):
            return web.json_response(out)
        async with open_stream(request) as stream:
            await send_events(stream, [(None, out), (None, "[DONE]")])
        return stream

    async def info(request: web.Request) -> web.Response:
        return web.json_response({"engine": "bench-instant", "weight_version": "0"})

    app = web.Application(client_max_size=1 << 30)
    app.add_routes([web.post("/generate", generate), web.get("/get_model_info", info), web.get("/health", info)])
    serve_app(app, "127.0.0.1", 0, "instant-engine", port_file=port_file, access_log=False)


class InstantEngine(ChildServer):
    def __init__(self, output_ids: list[int]):
        super().__init__("instant-engine")
        self.output_ids, self.url = output_ids, ""

    def start(self) -> "InstantEngine":
        (port,) = self.spawn_and_wait_port(
            [sys.executable, __file__, "--serve-engine", jsonio.dumps(self.output_ids)], 60
        )
        self.url = f"http://127.0.0.1:{port}"
        return self


# --- conversations --------------------------------------------------------------------------------
class Conversation:
    """A Claude Code-shaped conversation of about `tokens` tokens (`bytes_per_token` of the tokenizer)."""

    def __init__(self, text: str, bytes_per_token: float, tokens: int, new_tokens: int):
        self.text, self.pos, self.bpt = text, 0, bytes_per_token
        schema = {
            "type": "object",
            "properties": {
                "file_path": {"type": "string", "description": "absolute path"},
                "limit": {"type": "integer"},
            },
            "required": ["file_path"],
        }
        head_chars = int(min(4000, tokens // 3) * bytes_per_token)
        self.tools = [
            {"name": n, "description": self.take(head_chars // 24), "input_schema": schema} for n in TOOL_NAMES
        ]
        self.system = [{"type": "text", "text": "You are Claude Code, a coding agent. " + self.take(head_chars // 2)}]
        self.messages: list[dict] = [{"role": "user", "content": "Read the notes and fix the failing test."}]
        self.new_chars = int(new_tokens * bytes_per_token)
        self.num_chars, n = (
            len(self.system[0]["text"]) + len(jsonio.dumps(self.tools)) + 500,
            0,
        )  # 500: the template's own
        while self.num_chars < tokens * bytes_per_token:  # history the proxy never served (rendered from text)
            self.add_turn(
                {"type": "tool_use", "id": f"toolu_hist{n}", "name": "Read", "input": {"file_path": f"/repo/f{n}.py"}}
            )
            n += 1

    def take(self, n: int) -> str:
        if self.pos + n > len(self.text):
            self.pos = 0
        self.pos += n
        return self.text[self.pos - n : self.pos]

    def add_turn(self, tool_use: dict) -> str:
        """The assistant's tool_use and a tool_result of `new_chars` characters; returns the new text."""
        new = self.take(self.new_chars)
        self.num_chars += len(new)
        self.messages += [
            {"role": "assistant", "content": [tool_use]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use["id"], "content": new}]},
        ]
        return new

    def body(self) -> bytes:
        return jsonio.dumpb(
            {
                "model": "gyre",
                "max_tokens": 256,
                "stream": True,
                "system": self.system,
                "tools": self.tools,
                "messages": self.messages,
            }
        )


async def call(s: aiohttp.ClientSession, url: str, key: str, body: bytes) -> tuple[dict, int]:
    """One streamed /v1/messages call: (its tool_use block, the prompt tokens it reported)."""
    headers = {"x-api-key": key, "Content-Type": "application/json"}
    async with s.post(url + "/v1/messages?beta=true", data=body, headers=headers) as r:
        text = await r.text()
        assert r.status == 200, text[:500]
    tool_use, n_in = None, 0
    for line in text.splitlines():
        if line.startswith("data:"):
            ev = jsonio.loads(line[5:])
            if ev["type"] == "message_start":
                n_in = ev["message"]["usage"]["input_tokens"]
            elif ev["type"] == "content_block_start" and ev["content_block"]["type"] == "tool_use":
                tool_use = {**ev["content_block"], "input": {"file_path": "/repo/notes.txt"}}
            assert ev["type"] != "error", ev
    assert tool_use is not None, text[:500]
    return tool_use, n_in


def cpu_s(pids: list[int]) -> float:
    """CPU seconds the processes' threads ran (/proc schedstat: ns, unlike the 10 ms ticks of /proc stat)."""
    return (
        sum(int(Path(t, "schedstat").read_text().split()[0]) for p in pids for t in Path(f"/proc/{p}/task").iterdir())
        / 1e9
    )


def admin(url: str, token: str, path: str, body: dict) -> dict:
    import urllib.request

    req = urllib.request.Request(
        url + path,
        data=jsonio.dumps(body).encode(),
        method="POST",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return jsonio.loads(r.read())


class Proxies:
    """`num_workers` proxy worker processes (gyre.proxy.workers where it exists, else one process)."""

    def __init__(self, cfg: ProxyConfig, num_workers: int):
        try:
            from gyre.proxy.workers import ProxyWorkers
        except ImportError:  # main before horizontal scale: one process
            assert num_workers == 1, "this checkout has no gyre.proxy.workers"
            from gyre.proxy.main import ProxyProcess

            p = ProxyProcess(cfg).start()
            self.stop, self.pids = p.stop, [p.proc.pid]
            self.new_execution = lambda eid: (
                p.url,
                admin(p.url, p.admin_token, "/admin/executions", {"execution_id": eid})["api_key"],
            )
            return
        w = ProxyWorkers(cfg, num_workers).start()
        self.stop, self.pids = w.stop, w.pids
        self.new_execution = lambda eid: (
            w.url_for(eid),
            admin(w.url_for(eid), w.admin_token, "/admin/executions", {"execution_id": eid})["api_key"],
        )


async def idle_rate(pids: list[int], seconds: float = 2.0) -> float:
    c0, t0 = cpu_s(pids), time.monotonic()
    await asyncio.sleep(seconds)
    return (cpu_s(pids) - c0) / (time.monotonic() - t0)


async def measure_size(proxies: Proxies, tok, text: str, bpt: float, size: int, args, idle: float) -> dict:
    conv = Conversation(text, bpt, size - args.calls * args.new_tokens // 2, args.new_tokens)
    url, key = proxies.new_execution(f"size{size}-{type(tok).__name__}")
    floors, floor_toks, n_ins = [], [], []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
        tool_use, _ = await call(s, url, key, conv.body())  # renders the whole history: not measured
        bodies = []
        c0, t0 = cpu_s(proxies.pids), time.monotonic()
        for _ in range(args.calls):
            new = conv.add_turn(tool_use)
            body = conv.body()
            bodies.append((body, new))
            tool_use, n_in = await call(s, url, key, body)
            n_ins.append(n_in)
        used, wall = cpu_s(proxies.pids) - c0, time.monotonic() - t0
    for body, new in bodies:  # the floors, in this process, after the calls (so they never overlap them)
        floors.append(_cpu_of(jsonio.loads, body))  # once, as the proxy parses it
        floor_toks.append(floors[-1] + _cpu_of(tok.encode, new))
    return {
        "cpu_ms_per_call": (used - idle * wall) / args.calls * 1e3,
        "floor_ms": statistics.median(floors) * 1e3,
        "floor_tok_ms": statistics.median(floor_toks) * 1e3,
        "prompt_tokens": n_ins[-1],
        "body_mb": len(bodies[-1][0]) / 2**20,
    }


def _cpu_of(fn, arg) -> float:
    t = time.thread_time()
    fn(arg)
    return time.thread_time() - t


async def throughput(proxies: Proxies, text: str, args) -> float:
    sessions = [Conversation(text, 1.0, args.throughput_tokens, args.new_tokens) for _ in range(args.sessions)]
    keyed = [proxies.new_execution(f"tp{i}") for i in range(args.sessions)]

    async def run(conv: Conversation, url: str, key: str, s) -> None:
        tool_use, _ = await call(s, url, key, conv.body())
        for _ in range(args.calls):
            conv.add_turn(tool_use)
            tool_use, _ = await call(s, url, key, conv.body())

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
        t0 = time.monotonic()
        await asyncio.gather(*(run(c, u, k, s) for c, (u, k) in zip(sessions, keyed)))
        return args.sessions * (args.calls + 1) / (time.monotonic() - t0)


def proxy_config(tmp: Path, engine_url: str, tokenizer_path: str | None) -> ProxyConfig:
    return ProxyConfig(
        records_dir=str(RunPaths(tmp).records),
        engines=[engine_url],
        context_len=1 << 23,
        max_body_mb=256,
        tokenizer_path=tokenizer_path,
    )


def run_tokenizer(tmp: Path, tok, tokenizer_path: str | None, text: str, args) -> tuple[dict, dict]:
    """Per-size figures with one tokenizer, and (byte tokenizer only) calls/s per worker count."""
    bpt = len(text[:200_000].encode()) / len(tok.encode(text[:200_000]))
    engine = InstantEngine(tok.encode(TOOL_CALL) + [tok.eos_token_id]).start()
    sizes, rates = {}, {}
    try:
        proxies = Proxies(proxy_config(tmp / type(tok).__name__, engine.url, tokenizer_path), 1)
        try:
            idle = asyncio.run(idle_rate(proxies.pids, args.idle_s))
            for size in args.sizes:
                sizes[size] = asyncio.run(measure_size(proxies, tok, text, bpt, size, args, idle))
                print(
                    f"{type(tok).__name__:<14}{size:>9}{sizes[size]['cpu_ms_per_call']:>10.2f}{sizes[size]['floor_ms']:>10.2f}"
                    f"{sizes[size]['floor_tok_ms']:>10.2f}{sizes[size]['prompt_tokens']:>10}",
                    flush=True,
                )
        finally:
            proxies.stop()
        for n in args.workers if tokenizer_path is None else ():
            proxies = Proxies(proxy_config(tmp / f"w{n}", engine.url, None), n)
            try:
                rates[n] = asyncio.run(throughput(proxies, text, args))
                print(f"{n} worker(s): {rates[n]:.1f} calls/s", flush=True)
            finally:
                proxies.stop()
    finally:
        engine.stop()
    return sizes, rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="10000,100000,200000,1000000,2000000")
    ap.add_argument("--calls", type=int, default=4, help="measured calls per size")
    ap.add_argument("--new-tokens", type=int, default=1000, help="tokens of the tool result each call adds")
    ap.add_argument("--no-bpe", action="store_true", help="only the byte tokenizer")
    ap.add_argument("--bpe-sizes", default=None, help="sizes for the BPE tokenizer (default: --sizes)")
    ap.add_argument("--workers", default="1,2,4")
    ap.add_argument("--sessions", type=int, default=8, help="concurrent sessions of the throughput run")
    ap.add_argument("--throughput-tokens", type=int, default=100_000)
    ap.add_argument("--serve-engine", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port-file", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--idle-s", type=float, default=2.0, help="how long the proxy's idle CPU is measured")
    ap.add_argument("--smoke", action="store_true", help="smallest sizes, seconds (the test suite's run)")
    args = ap.parse_args()
    if args.smoke:
        args.sizes, args.calls, args.new_tokens, args.workers, args.sessions = "10000", 1, 100, "2", 2
        args.throughput_tokens, args.idle_s = 10_000, 0.2
    if args.serve_engine is not None:
        return serve_instant_engine(jsonio.loads(args.serve_engine), args.port_file)
    args.sizes = [int(s) for s in args.sizes.split(",")]
    args.workers = [int(w) for w in args.workers.split(",") if w]
    text = project_text()
    tmp = Path(tempfile.mkdtemp(prefix="gyre-bench-ctx-"))
    print(f"{'tokenizer':<14}{'tokens':>9}{'cpu ms':>10}{'floor':>10}{'floor+tok':>10}{'prompt':>10}")
    try:
        sizes, rates = run_tokenizer(tmp, ByteTokenizer(), None, text, args)
        bpe = {}
        if not args.no_bpe:
            path = make_bpe_model_dir(tmp / "bpe")
            args.sizes = [int(s) for s in (args.bpe_sizes or ",".join(map(str, args.sizes))).split(",")]
            args.workers = []
            bpe, _ = run_tokenizer(tmp, HFTokenizer(str(path)), str(path), text, args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out = {
        str(n): {
            **f,
            **{"bpe_" + k: v for k, v in bpe.get(n, {}).items() if k != "floor_tok_ms"},
            "floor_tok_ms": bpe.get(n, f)["floor_tok_ms"],
        }
        for n, f in sizes.items()
    }
    print(
        jsonio.dumps(
            {
                "sizes": out,
                "calls_per_s": {str(n): r for n, r in rates.items()},
                "new_tokens": args.new_tokens,
                "calls_per_size": args.calls,
                "cpus": psutil.cpu_count(),
                "loadavg_1m": psutil.getloadavg()[0],
            }
        )
    )


if __name__ == "__main__":
    main()
