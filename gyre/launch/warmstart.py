"""Warm start: a BPE vocabulary and supervised training of the tiny model on the toy set's reference transcripts.

RL from random weights never sees a reward; from a policy that sometimes succeeds it has a signal
at once. The transcripts are the toy agent's own calls (gyre/harness/toy_agent.py) with the
reference solution as the model's answers, parsed by the proxy's own request parser and rendered
with the tokenizer's chat template, so the prompts are token for token what the proxy sends the
engine. The vocabulary is a byte-level BPE trained with `tokenizers` on the same transcripts' text
(`gyre.models.tokenizer.train_bpe`), so the prompts are ~4x shorter than in bytes and a word of
the tasks is one or two tokens; it is saved with the weights (`bpe.json`), and the proxy renders
with it (`proxy.tokenizer_path`, set to the model directory by gyre-train). Training is next-token
cross-entropy on the assistant turns (the engine's functional model, engine-named weights), and
the result is a model directory in engine format (`save_checkpoint`), cached under a content
hash of the conversations, the settings and this module's code: a second run with the same inputs reuses it.

    python -m gyre.launch.warmstart --out DIR [--steps N --lr X --taskset PATH] [OVERRIDES]   # last line: JSON report

The command line makes what gyre-train makes with the same Hydra overrides (conf/model/tiny.yaml by
default), so it can fill the cache ahead of a run.
"""

import argparse
import hashlib
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import hydra
import torch
import torch.nn.functional as F

from gyre.common import CONF_DIR, jsonio
from gyre.common.files import atomic_path
from gyre.config import register_configs, validate
from gyre.harness import toy_agent as toy
from gyre.harness.evaluate import evaluate
from gyre.harness.workspace import make_workspace
from gyre.models.checkpoint import save_checkpoint
from gyre.models.config import ModelConfig
from gyre.models.tokenizer import BaseTokenizer, BPETokenizer, ByteTokenizer, Special, render_chat, train_bpe
from gyre.models.transformer import attend, forward_tokens, init_weights, logits_of
from gyre.proxy import anthropic as anthropic_wire
from gyre.proxy import openai as openai_wire
from gyre.tasks.spec import Task
from gyre.tasks.taskset import TaskSet, toy_taskset

SUB_REPORT = "task.md"


@dataclass(frozen=True)
class WarmStartConfig:
    steps: int = 200
    """Optimizer steps (batches of `batch_size` transcripts' turns)."""
    lr: float = 3e-3
    batch_size: int = 24
    seed: int = 0
    init_seed: int = 0
    max_tokens: int = 96
    clear_chars: int = toy.CLEAR_CHARS
    """The toy agent's `--clear-chars` (harness.toy.clear_chars): demonstrations clear old tool results as it does."""
    tokenizer: str = "bpe"
    """bpe: train a byte-level BPE vocabulary of the model's vocab_size on the transcripts; byte: bytes."""
    quitters: bool = True
    """Add, for every task, a demonstration of the main agent ending at once ("Done.", no tool
    call), which the evaluator scores 0. Demonstrations of mixed quality, as real SFT data has:
    the warm policy then acts on about half its first turns, one decision shared by every task,
    which RL can learn within the few steps of a local run."""

    def __post_init__(self):
        if self.tokenizer not in ("bpe", "byte"):
            raise ValueError(f"tokenizer must be one of bpe, byte; got {self.tokenizer!r}")


def parse_call(messages: list[dict], reply: dict, api: str = "openai") -> tuple[list[dict], list[dict], dict]:
    """(template messages, tools, reply message) of one toy-agent call as the proxy parses it on `api`."""
    if api == "anthropic":
        chat = anthropic_wire.parse_request(toy.make_anthropic_body("gyre", messages, 96, tools=True), ["gyre"])
    else:
        chat = openai_wire.parse_request(toy.make_openai_body("gyre", messages, 96, tools=True), ["gyre"], 96)
    reply_msg = {
        "role": "assistant",
        "content": reply["content"],
        "tool_calls": [{"name": c["name"], "arguments": c["arguments"]} for c in reply["tool_calls"]],
    }
    return chat.messages, chat.tools, reply_msg


def render_call(
    tok: BaseTokenizer, messages: list[dict], reply: dict, api: str = "openai"
) -> tuple[list[int], list[int]]:
    """(prompt ids as the proxy renders this toy-agent call on `api`, the reply's ids ending in <|im_end|>)."""
    chat_messages, tools, reply_msg = parse_call(messages, reply, api)
    prompt = tok.apply_chat_template(chat_messages, tools, add_generation_prompt=True)
    full = tok.apply_chat_template(chat_messages + [reply_msg], tools, add_generation_prompt=False)
    head = prompt[: -len(tok.encode("assistant\n")) - 1]  # the prompt without its generation prompt
    assert full[: len(head)] == head, "the chat template is not separable per turn"
    return prompt, full[len(prompt) : -len(tok.encode("\n"))]


def _conversation(
    system: str, prompt: str, turns: list[tuple[dict, list[str]]], clear_chars: int = toy.CLEAR_CHARS
) -> list[tuple[list[dict], dict]]:
    """(messages so far, reply) per call of one agent; each turn is a reply and its tools' results,
    old results cleared as the toy agent clears them."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
    out = []
    for reply, results in turns:
        messages = toy.clear_old_results(messages, clear_chars)
        out.append((list(messages), reply))
        messages.append({"role": "assistant", **reply})
        messages += [
            {"role": "tool", "tool_call_id": c["id"], "content": r} for c, r in zip(reply["tool_calls"], results)
        ]
    return out


def reference_conversations(task: Task, clear_chars: int = toy.CLEAR_CHARS) -> list[tuple[list[dict], dict]]:
    """The toy agent's calls when the model answers with the reference: survey sub-agent (ls,
    report), main agent (write each reference file, read the first back, then done; the write's
    result is cleared by then), verify sub-agent (ls, report); tool results as the toy agent's
    tools word them."""
    files = (task.reference or {}).get("files", {})
    survey = _survey(SUB_REPORT)
    verify = _survey("\n".join(sorted({SUB_REPORT, *files})))
    writes = {
        "content": "",
        "tool_calls": [
            {"id": f"call_w{i}", "name": "write_file", "arguments": {"path": p, "content": t}}
            for i, (p, t) in enumerate(files.items())
        ],
    }
    results = [f"wrote {len(t)} bytes to {p}" for p, t in files.items()]
    path, text = next(iter(files.items()))
    check = {"content": "", "tool_calls": [{"id": "call_r", "name": "read_file", "arguments": {"path": path}}]}
    main = _conversation(
        toy.MAIN_SYSTEM,
        toy.make_main_prompt(task.instruction, SUB_REPORT),
        [(writes, results), (check, [text]), ({"content": "Done.", "tool_calls": []}, [])],
        clear_chars,
    )
    return survey + main + verify


def _survey(listing: str) -> list[tuple[list[dict], dict]]:
    """A sub-agent's calls (ls, then the listing as its report) in a workspace holding `listing`."""
    ls = {"content": "", "tool_calls": [{"id": "call_ls", "name": "run", "arguments": {"command": "ls"}}]}
    return _conversation(
        toy.SUB_SYSTEM,
        toy.SUB_TASK,
        [(ls, [f"exit 0\n{listing}\n"]), ({"content": listing, "tool_calls": []}, [])],
    )


def quitting_conversation(task: Task) -> list[tuple[list[dict], dict]]:
    """The main agent's first call answered with "Done." and no tool call (it gives up)."""
    prompt = toy.make_main_prompt(task.instruction, SUB_REPORT)
    return _conversation(toy.MAIN_SYSTEM, prompt, [({"content": "Done.", "tool_calls": []}, [])])


def call_texts(messages: list[dict], reply: dict) -> list[str]:
    """The plain-text pieces of one rendered call, reply included: what the BPE vocabulary is trained on."""
    chat_messages, tools, reply_msg = parse_call(messages, reply)
    return [p for p in render_chat(chat_messages + [reply_msg], tools, False) if not isinstance(p, Special)]


def reference_transcript(tok: BaseTokenizer, task: Task, api: str = "openai") -> list[tuple[list[int], list[int]]]:
    """(prompt ids, target ids) of each reference call, rendered as the proxy renders them."""
    return [render_call(tok, messages, reply, api) for messages, reply in reference_conversations(task)]


def common_prefix(prompts: list[list[int]]) -> int:
    n = min(len(p) for p in prompts) - 1  # every prompt keeps at least one token of its own
    first = prompts[0]
    for p in prompts[1:]:
        n = next((i for i in range(n) if p[i] != first[i]), n)
    return n


def shared_prefix_loss(cfg: ModelConfig, weights: dict, examples: list) -> torch.Tensor:
    """Summed cross-entropy over the targets of examples that share a prompt prefix (one system
    prompt): the prefix is computed once and each example's rest attends to its keys and values."""
    n = common_prefix([p for p, _ in examples])
    cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def attend_prefix(i, q, k, v):
        cache[i] = (k, v)
        return attend(q, k, v, 0)

    forward_tokens(cfg, weights, torch.tensor(examples[0][0][:n]), torch.arange(n), attend_prefix)
    losses = []
    for prompt, target in examples:
        rest = torch.tensor(prompt[n:] + target)
        hidden = forward_tokens(
            cfg,
            weights,
            rest,
            torch.arange(n, n + len(rest)),
            lambda i, q, k, v: attend(q, torch.cat([cache[i][0], k]), torch.cat([cache[i][1], v]), n),
        )
        first = len(prompt) - n - 1
        logits = logits_of(cfg, weights, hidden[first : first + len(target)])
        losses.append(F.cross_entropy(logits.float(), torch.tensor(target), reduction="sum"))
    return sum(losses)


def group_examples(examples: list, end_id: int) -> list[list]:
    """Distinct examples grouped by their system prompt (the tokens up to the first `end_id`)."""
    groups: dict[tuple, dict] = {}
    for p, t in examples:
        groups.setdefault(tuple(p[: p.index(end_id) + 1]), {})[jsonio.dumps([p, t])] = (p, t)
    return [list(g.values()) for g in groups.values()]


def train(
    cfg: ModelConfig, weights: dict, examples: list, ws: WarmStartConfig, end_id: int
) -> tuple[dict, list[float]]:
    """AdamW steps; each draws up to `batch_size` examples from every system-prompt group and
    averages over all their target tokens (the main agent's long tool calls weigh most)."""
    params = {n: t.clone().requires_grad_(True) for n, t in weights.items()}
    opt = torch.optim.AdamW(params.values(), lr=ws.lr, weight_decay=0.0)
    decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1 - i / ws.steps)  # linear to 0: a sharper end
    rng, losses, groups = random.Random(ws.seed), [], group_examples(examples, end_id)
    for _ in range(ws.steps):
        batches = [rng.sample(g, min(ws.batch_size, len(g))) for g in groups]
        loss = sum(shared_prefix_loss(cfg, params, b) for b in batches) / sum(len(t) for b in batches for _, t in b)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params.values(), 1.0)
        opt.step()
        decay.step()
        losses.append(float(loss.detach()))
    return {n: t.detach() for n, t in params.items()}, losses


@torch.no_grad()
def sample(
    cfg: ModelConfig, weights: dict, prompt: list[int], max_tokens: int, stop: set[int], gen: torch.Generator
) -> tuple[list[int], list[float]]:
    """(output ids, their log-probs): temperature-1 sampling with a KV cache, as the engine samples."""
    cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    state = {"cached": 0}

    def attend_cached(i, q, k, v):
        if i in cache:
            k, v = torch.cat([cache[i][0], k]), torch.cat([cache[i][1], v])
        cache[i] = (k, v)
        return attend(q, k, v, state["cached"])

    out, logprobs = [], []
    new = torch.tensor(prompt)
    for _ in range(max_tokens):
        hidden = forward_tokens(
            cfg, weights, new, torch.arange(state["cached"], state["cached"] + len(new)), attend_cached
        )
        state["cached"] += len(new)
        logp = torch.log_softmax(logits_of(cfg, weights, hidden[-1:]).float(), -1)[0]
        token = int(torch.multinomial(logp.exp(), 1, generator=gen))
        out.append(token)
        logprobs.append(float(logp[token]))
        if token in stop:
            break
        new = torch.tensor([token])
    return out, logprobs


def score_turn(tok: BaseTokenizer, task: Task, output: list[int], workspace: Path):
    """Apply one sampled main-agent turn's tool calls to a fresh workspace and evaluate it."""
    ws = make_workspace(task.workspace, workspace)
    for c in tok.parse_assistant(output).tool_calls:
        toy.run_tool(c.name, c.arguments, ws)
    return evaluate(task, ws, "finished")


def score_policy(
    cfg: ModelConfig,
    weights: dict,
    tok: BaseTokenizer,
    tasks: list[Task],
    samples_per_task: int,
    seed: int,
    max_tokens: int,
) -> dict:
    """Mean score and success rate (score 1) of the main agent's first turn, sampled, applied, evaluated."""
    gen, scores = torch.Generator().manual_seed(seed), []
    with tempfile.TemporaryDirectory(prefix="gyre-warm-") as tmp:
        for task in tasks:
            prompt, _ = reference_transcript(tok, task)[2]
            for k in range(samples_per_task):
                output, _ = sample(cfg, weights, prompt, max_tokens, set(tok.stop_token_ids), gen)
                ev = score_turn(tok, task, output, Path(tmp) / f"{task.task_id}-{k}")
                if ev.outcome != "evaluator_error":
                    scores.append(ev.score)
    return {
        "mean_score": round(sum(scores) / len(scores), 4),
        "success_rate": round(sum(s == 1.0 for s in scores) / len(scores), 4),
        "num_samples": len(scores),
    }


def demonstrations(taskset: TaskSet, ws: WarmStartConfig) -> list[tuple[list[dict], dict]]:
    """(messages so far, reply) of every demonstrated call: the reference runs, and the giving-up ones."""
    calls = [c for t in taskset.tasks for c in reference_conversations(t, ws.clear_chars)]
    return calls + ([c for t in taskset.tasks for c in quitting_conversation(t)] if ws.quitters else [])


def content_hash(cfg: ModelConfig, ws: WarmStartConfig, calls: list) -> str:
    """Hash of everything the vocabulary and the weights depend on: settings, conversations, this module's code."""
    h = hashlib.sha256(jsonio.dumps([asdict(cfg), asdict(ws)], sort_keys=True, python_text=True).encode())
    h.update(Path(__file__).read_bytes())
    h.update(jsonio.dumps(calls, sort_keys=True, python_text=True).encode())
    return h.hexdigest()[:16]


def make_tokenizer(cfg: ModelConfig, ws: WarmStartConfig, calls: list, out: Path) -> BaseTokenizer:
    """The model's tokenizer: a BPE vocabulary trained on the calls' text into `out`, or bytes."""
    if ws.tokenizer == "byte":
        return ByteTokenizer(cfg.vocab_size)
    train_bpe([p for c in calls for p in call_texts(*c)], cfg.vocab_size, out)
    return BPETokenizer(out, cfg.vocab_size)


def train_into(
    out: Path, taskset: TaskSet, cfg: ModelConfig, ws: WarmStartConfig, calls: list, samples_per_task: int
) -> dict:
    """Train the vocabulary and the weights into the directory `out`; returns the report."""
    start, wall = time.process_time(), time.monotonic()
    tok = make_tokenizer(cfg, ws, calls, out)
    examples = [render_call(tok, *c) for c in calls]
    trained, losses = train(cfg, init_weights(cfg, ws.init_seed), examples, ws, tok.eos_token_id)
    train_cpu_s = time.process_time() - start
    after = score_policy(cfg, trained, tok, taskset.tasks, samples_per_task, ws.seed + 1, ws.max_tokens)
    save_checkpoint(out, cfg, trained)
    return {
        "tokenizer": ws.tokenizer,
        "num_examples": len(examples),
        "prompt_tokens_mean": round(sum(len(p) for p, _ in examples) / len(examples), 1),
        "target_tokens_mean": round(sum(len(t) for _, t in examples) / len(examples), 1),
        "steps": ws.steps,
        "lr": ws.lr,
        "loss_first": round(losses[0], 4),
        "loss_last": round(losses[-1], 4),
        "train_cpu_s": round(train_cpu_s, 1),
        "cpu_s": round(time.process_time() - start, 1),
        "wall_s": round(time.monotonic() - wall, 1),
        "after": after,
    }


def warm_start(
    out_root: Path,
    taskset: TaskSet | None = None,
    cfg: ModelConfig | None = None,
    ws: WarmStartConfig | None = None,
    samples_per_task: int = 1,
) -> tuple[Path, dict]:
    """The warm-started model directory under `out_root` (reused when its hash matches) and its report.

    The directory holds the weights in engine format and, with the BPE tokenizer, its `bpe.json`."""
    taskset, cfg, ws = taskset or toy_taskset(), cfg or ModelConfig(), ws or WarmStartConfig()
    calls = demonstrations(taskset, ws)
    out = Path(out_root) / f"warmstart-{content_hash(cfg, ws, calls)}"
    if (out / "report.json").exists():
        return out, {**jsonio.loads((out / "report.json").read_text()), "reused": True}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: a second thread costs more than it gives on a shared box
    Path(out_root).mkdir(parents=True, exist_ok=True)
    try:
        with atomic_path(out) as tmp:  # the whole directory appears at once: a crash never leaves half a cache
            tmp.mkdir()
            report = train_into(tmp, taskset, cfg, ws, calls, samples_per_task) | {"model_dir": str(out)}
            (tmp / "report.json").write_text(jsonio.dumps(report))
    except OSError:  # another run cached the same inputs first: keep its directory
        if not (out / "report.json").exists():
            raise
        return out, {**jsonio.loads((out / "report.json").read_text()), "reused": True}
    finally:
        torch.set_num_threads(threads)
    return out, {**report, "reused": False}


def main(argv: list[str] | None = None) -> None:
    """The warm start gyre-train makes for the same overrides (its model and the toy's clear_chars)."""
    p = argparse.ArgumentParser(prog="python -m gyre.launch.warmstart", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="cache directory; the model goes to OUT/warmstart-<hash>")
    p.add_argument("--taskset", default=None)
    p.add_argument("--steps", type=int, default=WarmStartConfig.steps)
    p.add_argument("--lr", type=float, default=WarmStartConfig.lr)
    p.add_argument("--samples-per-task", type=int, default=1)
    p.add_argument("overrides", nargs="*", help="gyre-train's Hydra overrides (e.g. model.hidden_size=256)")
    a = p.parse_args(argv)
    register_configs()
    with hydra.initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = validate(hydra.compose(config_name="config", overrides=a.overrides))
    torch.set_num_threads(1)
    taskset = TaskSet.load(a.taskset) if a.taskset else None
    ws = WarmStartConfig(steps=a.steps, lr=a.lr, clear_chars=cfg.harness.toy.clear_chars)
    out, report = warm_start(Path(a.out), taskset, cfg.model, ws, samples_per_task=a.samples_per_task)
    print(jsonio.dumps(report))


if __name__ == "__main__":
    main()
