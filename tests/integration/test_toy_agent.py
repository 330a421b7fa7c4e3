"""The toy agent through a real proxy and builtin engine: it completes a toy task, and its records
rebuild into a call tree with its two sub-agents, a compaction summary, and the branch its clearing
of old tool results makes; its HTTP client retries and fails as the official SDKs do."""

import asyncio
import dataclasses
import json
import threading

import pytest
from aiohttp import web
from proxy_fixtures import new_execution, start_engine, start_proxy

from gyre.harness import toy_agent
from gyre.harness.config import HarnessConfig, ToyAgentConfig
from gyre.harness.evaluate import evaluate
from gyre.harness.sandbox import Sandbox
from gyre.launch.warmstart import reference_conversations, reference_transcript, render_call
from gyre.models.tokenizer import ByteTokenizer
from gyre.records.io import read_records
from gyre.tasks.taskset import toy_taskset
from gyre.trajectory.config import TrajectoryConfig
from gyre.trajectory.process import process_execution
from gyre.trajectory.tree import build_call_tree

WRITE = '<tool_call>\n{"name": "write_file", "arguments": {"path": "answer.txt", "content": "apple"}}\n</tool_call>'
READ = '<tool_call>\n{"name": "read_file", "arguments": {"path": "answer.txt"}}\n</tool_call>'
RULES = [  # the scripted policy forces these outputs for prompts whose unanswered part matches
    {"match": "Do NOT call any tools", "emit": "Wrote apple to answer.txt."},
    {"match": "List the files", "emit": '<tool_call>\n{"name": "run", "arguments": {"command": "ls"}}\n</tool_call>'},
    {"match": "exit 0\nanswer.txt", "emit": "answer.txt\ntask.md"},  # the verify sub-agent's listing
    {"match": "exit 0", "emit": "task.md"},
    {"match": "Summary so far", "emit": "Done."},
    {"match": "wrote 5 bytes", "emit": READ},  # no compaction: the reference path reads its answer back
    {"match": "<tool_response>\napple\n", "emit": "Done."},
    {"match": 'Write "apple"', "emit": WRITE},
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("toy")
    engine = start_engine(tmp, RULES)
    proxy = start_proxy(tmp, [engine.url])
    yield tmp, proxy
    proxy.stop()
    engine.stop()


@pytest.mark.parametrize("api", ["anthropic", "openai"])
def test_toy_agent_completes_task_and_records_form_a_tree(stack, api):
    tmp, proxy = stack
    task = dataclasses.replace(toy_taskset().get("word-apple"), time_budget_s=120)  # a loaded box is slow
    ex = f"toy-{api}"
    harness = HarnessConfig(kind="toy", toy=ToyAgentConfig(api=api, compact_chars=60, tool_median_s=0.01))
    sb = Sandbox(task, ex, tmp / "sandboxes", harness, proxy.url, new_execution(proxy, ex), "gyre")
    sb.prepare()
    sb.start()
    r = sb.wait()
    log = r.log_path.read_text()
    assert (r.exit_code, r.timed_out) == (0, False), log
    # survey 2, main 1, summary 1, resumed main 1, verify 2
    assert json.loads(log.strip().splitlines()[-1])["num_calls"] == 7
    assert evaluate(task, r.workspace, "finished").score == 1.0
    records, _ = read_records(tmp / "records" / f"{ex}.jsonl")
    tree = build_call_tree(records)
    kinds = [n.kind for n in tree.nodes]
    sub = [n for n in tree.nodes if n.kind == "subagent"]
    assert len(sub) == 4 and sub[1].parent == tree.nodes.index(sub[0]) and sub[3].parent == tree.nodes.index(sub[2])
    assert {n.record.parent_agent_id for n in sub} == {"main"} and sub[0].record.agent_id != sub[2].record.agent_id
    assert sub[0].record.agent_id.startswith("sub-") and sub[0].spawned_by is None
    # Both APIs hint summaries (chat completions through x-gyre-call-kind); a summary continues the main conversation.
    summary = next(n for n in tree.nodes if n.kind == "summary")
    assert tree.nodes[summary.parent].kind == "main"
    assert kinds.count("main") == 2
    roots = [n for n in tree.nodes if n.parent is None and n.kind == "main"]
    assert len(roots) == 2  # the first conversation and the one restarted from the summary


def test_warm_start_transcripts_are_what_the_proxy_renders(stack):
    """The warm start's prompts and targets equal the proxy's records of the same conversation
    (the default API, chat completions; the Messages API renders the same ids, checked in-process)."""
    tmp, proxy = stack
    task = dataclasses.replace(toy_taskset().get("word-apple"), time_budget_s=120)  # a loaded box is slow
    harness = HarnessConfig(kind="toy", toy=ToyAgentConfig(tool_median_s=0.0))
    sb = Sandbox(task, "ref", tmp / "sandboxes", harness, proxy.url, new_execution(proxy, "ref"), "gyre")
    sb.prepare()
    sb.start()
    assert sb.wait().exit_code == 0
    records = sorted(read_records(tmp / "records" / "ref.jsonl")[0], key=lambda r: r.seq)
    tok = ByteTokenizer(512)
    transcript = reference_transcript(tok, task)
    assert len(records) == len(transcript) == 7
    assert [render_call(tok, *c, api="anthropic") for c in reference_conversations(task)] == transcript
    for r, (prompt, target) in zip(records, transcript):
        assert r.input_ids.tolist() == prompt
        assert r.output_ids.tolist() == target
    # The last call saw the write's result cleared: it branches off the write, whose targets two
    # paths then share, and the dedup counts them once.
    tree = build_call_tree(records)
    assert tree.nodes[4].parent == tree.nodes[3].parent == 2 and toy_agent.CLEARED in tok.decode(
        records[4].input_ids.tolist()
    )
    # The verify sub-agent's `ls` is the survey's (same prompt, same call): one node, counted once.
    counts = process_execution(records, TrajectoryConfig()).counts
    assert counts.targets_dedup == counts.targets_capped - records[2].output_ids.size - records[5].output_ids.size
    # The toy's cap of 3 drops the survey's path (the earlier sub-agent); the verify's keeps its call.
    capped = process_execution(records, TrajectoryConfig(max_paths=3))
    assert capped.left_out["over_cap"] == 1 and capped.counts.targets_capped < capped.counts.targets_naive
    assert {s.leaf_call_id for s in capped.samples if s.path_class == "subagent"} == {records[6].call_id}


@pytest.fixture
def flaky_proxy():
    """A stand-in proxy on a free port that answers each call with the next (status, body) of
    `script` (then 200 with a reply), recording each request's headers."""
    script, seen = [], []

    async def answer(request):
        seen.append(dict(request.headers) | {"path": request.path, "body": await request.json()})
        status, body = script.pop(0) if script else (200, REPLIES[request.path])
        return web.json_response(body, status=status)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    app.router.add_post("/v1/messages", answer)
    runner, loop, ready = web.AppRunner(app), asyncio.new_event_loop(), threading.Event()

    def serve():
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(30)
    yield f"http://127.0.0.1:{runner.addresses[0][1]}", script, seen
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(30)


REPLIES = {
    "/v1/chat/completions": {"choices": [{"message": {"role": "assistant", "content": "ok"}}]},
    "/v1/messages": {"content": [{"type": "text", "text": "ok"}]},
}


@pytest.mark.parametrize(
    "api, key_header, overloaded", [("openai", "Authorization", 503), ("anthropic", "x-api-key", 529)]
)
def test_the_toy_agents_client_retries_as_the_sdks_do_and_fails_with_the_body(flaky_proxy, api, key_header, overloaded):
    """An overloaded proxy (the status each API's proxy answers) and a rate limit are retried, up
    to the SDKs' two retries; a refused call is not, and its error carries the body."""
    url, script, seen = flaky_proxy
    client = toy_agent.ApiClient(api, url, "key-1")
    script += [(overloaded, {"error": "overloaded"}), (429, {"error": "slow down"})]
    assert client.post({"model": "gyre"}, {"x-gyre-agent-id": "sub-1"}) == REPLIES[seen[0]["path"]]
    assert len(seen) == 3 and "key-1" in seen[-1][key_header] and seen[-1]["x-gyre-agent-id"] == "sub-1"
    script += [(500, {"error": "down"})] * 3
    with pytest.raises(toy_agent.ApiCallError, match="500.*down"):
        client.post({"model": "gyre"}, {})
    assert len(seen) == 3 + 3  # the call and its two retries
    script.append((400, {"error": "prompt is too long"}))
    with pytest.raises(toy_agent.ApiCallError, match="400.*prompt is too long"):
        client.post({"model": "gyre"}, {})
    assert len(seen) == 3 + 3 + 1
