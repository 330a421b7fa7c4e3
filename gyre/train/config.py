"""Trainer configuration: parallel layout, optimizer, policy loss, checkpoints, elastic micro-steps."""

from dataclasses import dataclass

from gyre.errors import require


@dataclass(kw_only=True)
class TrainerConfig:
    """Settings of the megatron-core trainer on the core cell and on satellite cells."""

    tensor_parallel_size: int = 1
    """Ranks one model is split over inside a cell (Megatron TP); must divide KV heads and vocab.
    The cell's other ranks are data-parallel replicas (micro-steps split among them)."""
    lr: float = 1e-6
    """Adam learning rate (after the warm-up)."""
    lr_warmup_steps: int = 0
    """Optimizer steps over which the learning rate rises linearly to `lr` (0: constant). Adam's
    first steps move every weight by about `lr` whatever the gradient's size (its moments are one
    noisy sample): a warm-up keeps the first RL steps from undoing the starting policy."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    """Clip the global gradient L2 norm to this (0 = no clipping)."""
    clip_ratio_low: float = 0.2
    """PPO clip: the ratio pi/pi_behaviour is clipped below at 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.28
    """PPO clip: ... and above at 1 + clip_ratio_high (asymmetric, as in DAPO)."""
    truncation_cap: float = 3.0
    """Truncated importance weight for stale samples (dual clip): with a negative advantage a
    token's ratio counts at most this much; 0 disables. Must exceed 1."""
    kl_coef: float = 0.0
    """Weight of the k3 KL estimate to the behaviour policy (0 = off)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (0 = off; > 0 materialises full-vocabulary logits)."""
    bf16: bool = True
    """Compute in bf16 autocast on CUDA; CPU always runs fp32."""
    checkpoint_keep_last: int = 3
    """Complete checkpoints to keep; older ones are deleted after each successful save."""
    offload_on_switch: bool = True
    """A satellite's trainer state (weights, optimizer state; its gradient buffer is freed) leaves the
    device while the cell serves and comes back when it trains (role-switch phases offload_trainer,
    onload_trainer), so the engine can have the memory; the core never serves and keeps it."""
    core_computes_microsteps: bool = True
    """The core cell computes micro-steps too; False leaves them to satellites (core only sums and steps)."""
    num_grad_slots: int = 4
    """Gradient buffers on each core rank that micro-steps are written into (each the size of the
    rank's shard), the slots of its data-parallel replica: K slots per replica let K x replicas
    micro-steps be in flight at once, at K shards of memory per rank."""
    claim_timeout_s: float = 0.0
    """A satellite holding a micro-step longer than this is presumed hung: the micro-step is redone
    elsewhere and the satellite gets no more work. 0 = wait as long as its connection is alive."""
    claim_poll_s: float = 0.005
    """How long an idle satellite waits before asking the core for work again."""
    collective_timeout_s: float = 1800.0
    """A collective of the cell's process group that waits longer raises (torch.distributed's
    timeout): a rank hung inside one ends the cell. Must exceed the longest micro-step (a replica
    without a job waits in a collective while another computes); idle ranks are pinged well within it."""
    rank_hang_timeout_s: float = 60.0
    """A follower rank whose heartbeat rank 0 has not heard for this long (stopped, e.g. SIGSTOP,
    or hung) is taken for dead, and its cell is lost as for a rank that exited. 0 = only exits count."""

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step `step` (0-based): linear warm-up, then constant.
        A function of the step alone, so a resumed run continues the schedule exactly."""
        warmup = self.lr_warmup_steps
        return self.lr * min(1.0, (step + 1) / warmup) if warmup else self.lr

    def __post_init__(self):
        require(
            self.tensor_parallel_size >= 1, "tensor_parallel_size", f"must be >= 1, got {self.tensor_parallel_size}"
        )
        require(self.lr > 0, "lr", f"must be > 0, got {self.lr}")
        require(self.lr_warmup_steps >= 0, "lr_warmup_steps", f"must be >= 0, got {self.lr_warmup_steps}")
        require(0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1, "adam_beta1", "betas must lie in [0, 1)")
        require(self.max_grad_norm >= 0, "max_grad_norm", f"must be >= 0 (0 disables), got {self.max_grad_norm}")
        require(0 <= self.clip_ratio_low < 1, "clip_ratio_low", f"must lie in [0, 1), got {self.clip_ratio_low}")
        require(self.clip_ratio_high >= 0, "clip_ratio_high", f"must be >= 0, got {self.clip_ratio_high}")
        require(
            self.truncation_cap == 0 or self.truncation_cap > 1,
            "truncation_cap",
            f"must be > 1 (or 0 to disable), got {self.truncation_cap}",
        )
        require(self.kl_coef >= 0, "kl_coef", f"must be >= 0, got {self.kl_coef}")
        require(self.entropy_coef >= 0, "entropy_coef", f"must be >= 0, got {self.entropy_coef}")
        require(
            self.checkpoint_keep_last >= 1, "checkpoint_keep_last", f"must be >= 1, got {self.checkpoint_keep_last}"
        )
        require(self.num_grad_slots >= 1, "num_grad_slots", f"must be >= 1, got {self.num_grad_slots}")
        require(self.claim_timeout_s >= 0, "claim_timeout_s", f"must be >= 0 (0 disables), got {self.claim_timeout_s}")
        require(self.claim_poll_s > 0, "claim_poll_s", f"must be > 0, got {self.claim_poll_s}")
        require(self.collective_timeout_s > 0, "collective_timeout_s", f"must be > 0, got {self.collective_timeout_s}")
        require(
            self.rank_hang_timeout_s >= 0,
            "rank_hang_timeout_s",
            f"must be >= 0 (0 disables), got {self.rank_hang_timeout_s}",
        )
