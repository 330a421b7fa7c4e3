"""Is the toy set learnable by RL from the warm start, and at which learning rate? (in process)

Each step samples G first main-agent turns for each of K tasks from the current weights (the
engine's functional model, temperature 1, the prompts the proxy renders), scores them with the
task's real evaluator, computes GRPO advantages per task group and takes one PPO step with the
real megatron-core trainer (`gyre.train.trainer.Trainer`). Side by side for each learning rate
from the same warm start and the same task order.

    python tools/bench/learnability.py --model-dir DIR [--lrs 1e-4,1e-3] [--steps 8] [--warmup N]   # last line: JSON

--smoke (the test suite's run): the random tiny model and the byte tokenizer instead of a warm
start, one learning rate, 2 steps of one task sampled twice: sampling, scoring and advantages in
seconds; the PPO step only runs for a group whose rewards differ, which a random model's never do.
"""

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from gyre.common import jsonio
from gyre.launch.warmstart import reference_transcript, sample, score_turn
from gyre.models.checkpoint import load_checkpoint
from gyre.models.config import ModelConfig
from gyre.models.tokenizer import load_tokenizer
from gyre.models.transformer import init_weights
from gyre.tasks.taskset import toy_taskset
from gyre.train.config import TrainerConfig
from gyre.train.trainer import Trainer
from gyre.trajectory.config import TrajectoryConfig
from gyre.trajectory.rewards import group_advantages
from gyre.trajectory.sample import PackedBatch


def make_batch(seqs: list[tuple[list[int], list[int], list[float], float, str]]) -> PackedBatch:
    """(prompt, output, behaviour log-probs, advantage, id) rows packed; each sequence weighs 1."""
    tokens, pos, cu, mask, lp, w, adv = [], [], [0], [], [], [], []
    for prompt, out, logp, a, _ in seqs:
        n = len(prompt) + len(out)
        tokens += prompt + out
        pos += list(range(n))
        cu.append(cu[-1] + n)
        mask += [False] * len(prompt) + [True] * len(out)
        lp += [0.0] * len(prompt) + logp
        w += [0.0] * len(prompt) + [1.0 / len(out)] * len(out)
        adv += [0.0] * len(prompt) + [a] * len(out)
    t = torch.tensor
    return PackedBatch(
        tokens=t(tokens),
        position_ids=t(pos),
        cu_seqlens=t(cu, dtype=torch.int32),
        target_mask=t(mask),
        behaviour_logprobs=t(lp, dtype=torch.float32),
        loss_weights=t(w, dtype=torch.float32),
        advantages=t(adv, dtype=torch.float32),
        weight_versions=torch.zeros(len(tokens), dtype=torch.int64),
        execution_ids=tuple(s[4] for s in seqs),
    )


def run(
    model_dir: str | None, lr: float, steps: int, tasks_per_step: int, group: int, seed: int, warmup: int
) -> list[float]:
    """Mean reward per step; `model_dir` None: the random tiny model (--smoke)."""
    cfg, weights = load_checkpoint(model_dir) if model_dir else (ModelConfig(), init_weights(ModelConfig(), seed))
    trainer = Trainer(cfg, TrainerConfig(lr=lr, lr_warmup_steps=warmup), seed=seed)
    trainer.load_engine_weights(weights)
    tok, ts, gen = load_tokenizer(model_dir, cfg.vocab_size), toy_taskset(), torch.Generator().manual_seed(seed)
    traj, means = TrajectoryConfig(), []
    with tempfile.TemporaryDirectory(prefix="gyre-learn-") as tmp:
        for step in range(steps):
            current = trainer.engine_weights()
            seqs, rewards = [], []
            for k in range(tasks_per_step):
                task = ts.pick(seed, step * tasks_per_step + k)
                prompt = reference_transcript(tok, task)[2][0]
                group_rewards, outs = {}, {}
                for g in range(group):
                    out, logp = sample(cfg, current, prompt, 96, set(tok.stop_token_ids), gen)
                    ev = score_turn(tok, task, out, Path(tmp) / f"{step}-{k}-{g}")
                    if ev.outcome == "evaluator_error":
                        continue
                    group_rewards[f"{k}-{g}"], outs[f"{k}-{g}"] = ev.score, (out, logp)
                rewards += group_rewards.values()
                advantages, _ = group_advantages(group_rewards, traj)
                seqs += [(prompt, *outs[i], a, i) for i, a in advantages.items()]
            means.append(float(np.mean(rewards)))
            if seqs:
                trainer.train_step([make_batch(seqs)])
            print(
                f"lr {lr:g} step {step}: mean reward {means[-1]:.3f} over {len(rewards)} samples, {len(seqs)} trained",
                flush=True,
            )
    return means


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", help="the warm start's model directory (required without --smoke)")
    p.add_argument("--lrs", default="1e-4,1e-3")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--tasks-per-step", type=int, default=4)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=0, help="trainer.lr_warmup_steps")
    p.add_argument("--smoke", action="store_true", help="smallest sizes, seconds (the test suite's run)")
    a = p.parse_args()
    if a.smoke:
        a.lrs, a.steps, a.tasks_per_step, a.group = "1e-4", 2, 1, 2
    elif not a.model_dir:
        p.error("--model-dir is required (or --smoke)")
    torch.set_num_threads(1)
    out = {}
    for lr in [float(x) for x in a.lrs.split(",")]:
        start = time.process_time()
        means = run(a.model_dir, lr, a.steps, a.tasks_per_step, a.group, a.seed, a.warmup)
        k = min(3, len(means) // 2)
        out[f"lr_{lr:g}"] = {
            "first": round(float(np.mean(means[:k])), 3),
            "last": round(float(np.mean(means[-k:])), 3),
            "per_step": [round(m, 3) for m in means],
            "cpu_s": round(time.process_time() - start, 1),
        }
        print(
            f"lr {lr:g}: mean reward first {k} steps {out[f'lr_{lr:g}']['first']}, last {k} {out[f'lr_{lr:g}']['last']}"
        )
    print(jsonio.dumps(out))


if __name__ == "__main__":
    main()
