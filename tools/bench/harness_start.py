"""The toy agent's start-up cost: CPU seconds of one start (interpreter, imports, first model call
against a stand-in that answers at once, then exit), per API, beside the bare interpreter and the
official SDKs' imports (what a start paid when the toy agent used them).

    python tools/bench/harness_start.py [--runs N]    # last line: one JSON object
    python tools/bench/harness_start.py --smoke       # the test suite's run: one start per API

The harness's CPU is spent outside the cells' CPU caps, on the box's spare cores, once per
execution: a start that costs a large part of a model call's CPU skews every mode's figures. CPU
is this process's waited-for children's user + system time (os.times, from /proc): the stand-in
server runs in this process and is not counted. Each figure is the median of N runs, the starts
of the two APIs interleaved with the references.
"""

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from aiohttp import web

from gyre.common import jsonio

ROOT = Path(__file__).resolve().parents[2]
CHAT_REPLY = {
    "id": "chatcmpl-0",
    "object": "chat.completion",
    "created": 0,
    "model": "gyre",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Done."}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}
MESSAGES_REPLY = {
    "id": "msg_0",
    "type": "message",
    "role": "assistant",
    "model": "gyre",
    "content": [{"type": "text", "text": "Done."}],
    "stop_reason": "end_turn",
    "stop_sequence": None,
    "usage": {"input_tokens": 1, "output_tokens": 1},
}
REFERENCES = {"python_bare": "pass", "import_openai_sdk": "import openai", "import_anthropic_sdk": "import anthropic"}


def children_cpu_s() -> float:
    t = os.times()
    return t.children_user + t.children_system


def start_stand_in() -> str:
    """A server answering chat completions and Messages API calls with a reply without tool calls
    (the agent's last turn), in a daemon thread; returns its URL."""
    app = web.Application()
    app.router.add_post("/v1/chat/completions", lambda _: web.json_response(CHAT_REPLY))
    app.router.add_post("/v1/messages", lambda _: web.json_response(MESSAGES_REPLY))
    runner, ready = web.AppRunner(app), threading.Event()

    def serve() -> None:
        loop = asyncio.new_event_loop()
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())  # a free port
        ready.set()
        loop.run_forever()

    threading.Thread(target=serve, daemon=True).start()
    if not ready.wait(30):
        raise RuntimeError("the stand-in server did not start in 30 s")
    return f"http://127.0.0.1:{runner.addresses[0][1]}"


def cpu_of(argv: list[str], cwd: Path, env: dict[str, str]) -> float:
    """CPU seconds of one child run to its end (it must exit 0)."""
    before = children_cpu_s()
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"{argv[:4]} exited {done.returncode}: {done.stderr[-2000:]}")
    return children_cpu_s() - before


def toy_start_argv(api: str) -> list[str]:
    """One toy-agent execution that makes exactly one call (no sub-agents, one turn)."""
    return [sys.executable, "-m", "gyre.harness.toy_agent", "Say done.", f"--api={api}", "--max-turns=1"] + [
        "--no-subagent",
        "--no-verify",
    ]


def measure(runs: int, url: str) -> dict[str, list[float]]:
    figures: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="gyre-bench-start-") as tmp:
        env = dict(os.environ, GYRE_PROXY_URL=url, GYRE_API_KEY="k", GYRE_MODEL="gyre", HOME=tmp)
        # a PYTHONPATH given first: `PYTHONPATH=<another checkout>` measures that checkout's agent
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH", ""), str(ROOT)]))
        for _ in range(runs):
            for api in ("openai", "anthropic"):
                (Path(tmp) / "toy-session.json").unlink(missing_ok=True)  # each start a fresh execution
                figures.setdefault(f"toy_start_{api}", []).append(cpu_of(toy_start_argv(api), Path(tmp), env))
            for name, code in REFERENCES.items():
                figures.setdefault(name, []).append(cpu_of([sys.executable, "-c", code], Path(tmp), env))
    return figures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--smoke", action="store_true", help="one run of each")
    a = p.parse_args()
    figures = measure(1 if a.smoke else a.runs, start_stand_in())
    out = {f"{name}_cpu_s": round(statistics.median(v), 3) for name, v in figures.items()}
    for name, v in figures.items():
        print(f"{name:24s} median {statistics.median(v):.3f} CPU-s  (min {min(v):.3f}, max {max(v):.3f}, n={len(v)})")
    out["runs"] = len(figures["python_bare"])
    out["load_1min"] = os.getloadavg()[0]
    print(jsonio.dumps(out))


if __name__ == "__main__":
    main()
