"""A seeded in-process RL loop that must learn, so that a bug which quietly stops learning fails a test.

The toy is a bandit inside an agent loop, run through the real pieces: the engine's forward samples
each call and records its behaviour log-probs, `CallRecord`s go through the trajectory processor
(`process_group`: call tree, target mask, GRPO advantages, loss weights), the real packer, and one
PPO step of the megatron-core trainer (`Trainer.train_step`, TrainerConfig's clip and truncation).

Each execution of question Q has two main-agent calls: the agent answers (answer token, then one
free "chatter" token), a tool result comes back, and the agent answers again. The reward is the
fraction of the two answers equal to the question's right answer T. A short warm start makes the
policy prefer a wrong answer W, and the tool result repeats the pair (Q, W) twenty times, so:

- flipped advantage sign: T is pushed down, W up;
- loss mask dropped: the tool result's W tokens, predicted right after Q, are trained with the
  rewarded executions' positive advantage, which holds W up (their ratio is pi(W) / exp(0), so
  they weigh only as much as the policy already believes them: hence the warm start and the twenty);
- behaviour log-probs off by one token: the answer's ratio takes the chatter token's log-prob
  (near-uniform, about -3.5) or 0, far from 1 either way, so the clip and the dual-clip truncation
  silence the answers or drown them in the chatter's gradient.

Such bugs that also leave a log-prob outside the targets, or a target without a weight version,
are stopped before the loss by `screen_batch` (BatchError), which fails this test as well.
"""

import numpy as np
import pytest
import torch
from _train_ref import as_samples

from gyre.models.config import ModelConfig
from gyre.models.transformer import attend, forward_tokens, logits_of
from gyre.records.record import CallRecord
from gyre.train.config import TrainerConfig
from gyre.train.trainer import Trainer
from gyre.trajectory.config import TrajectoryConfig
from gyre.trajectory.pack import pack
from gyre.trajectory.process import process_group
from gyre.trajectory.rewards import Evaluation

MODEL = ModelConfig(
    num_layers=1,
    hidden_size=32,
    ffn_hidden_size=64,
    num_attention_heads=2,
    num_query_groups=1,
    vocab_size=32,
    max_seq_len=64,
)
QUESTIONS, RIGHT, WRONG = (0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)
GROUP, STEPS, WARM_STEPS, TOOL_PAIRS = 12, 50, 6, 20


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    torch.set_num_threads(1)


def next_logprobs(weights: dict, tokens: list[int]) -> torch.Tensor:
    """The engine's log-probs of the token after `tokens` (the builtin engine's forward)."""
    ids, pos = torch.tensor(tokens), torch.arange(len(tokens))
    hidden = forward_tokens(MODEL, weights, ids, pos, lambda i, q, k, v: attend(q, k, v, 0))
    return torch.log_softmax(logits_of(MODEL, weights, hidden[-1:]).float(), -1)[0]


def call(weights: dict, eid: str, seq: int, prompt: list[int], gen: torch.Generator) -> CallRecord:
    """One model call: an answer token and a chatter token sampled at temperature 1, as the proxy records it."""
    out, logprobs = [], []
    for _ in range(2):
        lp = next_logprobs(weights, prompt + out)
        token = int(torch.multinomial(lp.exp(), 1, generator=gen))
        out.append(token)
        logprobs.append(float(lp[token]))
    return CallRecord.build(
        execution_id=eid,
        call_id=f"c{seq}",
        seq=seq,
        agent_id="main",
        parent_agent_id=None,
        kind_hint="main",
        input_ids=prompt,
        output_ids=out,
        logprobs=logprobs,
        versions=[0, 0],
        finish_reason="stop",
        started_at=float(seq),
        finished_at=seq + 0.5,
    )


def execution(weights: dict, k: int, eid: str, gen: torch.Generator) -> tuple[list[CallRecord], Evaluation]:
    """Answer, a tool result that shows the wrong answer after the question, answer again."""
    first = call(weights, eid, 0, [QUESTIONS[k]], gen)
    tool_result = [QUESTIONS[k], WRONG[k]] * TOOL_PAIRS + [QUESTIONS[k]]
    second = call(weights, eid, 1, [QUESTIONS[k], *first.output_ids.tolist(), *tool_result], gen)
    score = sum(int(r.output_ids[0]) == RIGHT[k] for r in (first, second)) / 2
    return [first, second], Evaluation("finished", score)


def answer_probs(trainer: Trainer) -> np.ndarray:
    """[question, (right, wrong)]: the policy's first-turn probability of each answer."""
    w = trainer.engine_weights()
    return np.array([next_logprobs(w, [q]).exp()[[r, x]].tolist() for q, r, x in zip(QUESTIONS, RIGHT, WRONG)])


def warm_start(trainer: Trainer) -> None:
    """A few on-policy steps towards the wrong answer (advantage 1): a policy RL has to talk out of it."""
    for _ in range(WARM_STEPS):
        w = trainer.engine_weights()
        seqs = [
            {"prompt": [q], "output": [x], "logprobs": [float(next_logprobs(w, [q])[x])], "advantage": 1.0}
            for q, x in zip(QUESTIONS, WRONG)
        ]
        trainer.train_step([pack(as_samples(seqs))])


def test_rl_loop_learns_the_rewarded_answer():
    trainer = Trainer(MODEL, TrainerConfig(lr=1e-2), seed=0)
    warm_start(trainer)
    before = answer_probs(trainer)
    gen, traj, rewards = torch.Generator().manual_seed(0), TrajectoryConfig(), []
    for step in range(STEPS):
        w = trainer.engine_weights()
        samples, scores = [], []
        for k in range(len(QUESTIONS)):
            group = [execution(w, k, f"s{step}q{k}g{g}", gen) for g in range(GROUP)]
            scores += [e.score for _, e in group]
            samples += process_group(group, traj).samples
        rewards.append(float(np.mean(scores)))
        if samples:
            trainer.train_step([pack(samples)])
    after = answer_probs(trainer)
    right, wrong = (f"{before[:, i].round(3)} -> {after[:, i].round(3)}" for i in (0, 1))
    report = f"p(right answer) {right}, p(wrong answer) {wrong}"
    assert after[:, 0].mean() > 0.45, report
    assert (after[:, 0] > after[:, 1]).all(), report
    assert np.mean(rewards[-5:]) > np.mean(rewards[:5]) + 0.4, f"reward per step {np.round(rewards, 2).tolist()}"
    assert before[:, 0].mean() < 0.05 and before[:, 1].mean() > 0.2, f"the warm start should prefer W: {report}"
