"""The trainer of one cell: recompute log-probs, compute a micro-step's gradient, apply a step.

A packed micro-batch is unpacked into a right-padded [S, L_max] batch with one causal mask, so each
sequence sees RoPE positions 0..L-1 exactly as the engine did (megatron-core's RoPE without
packed_seq_params counts positions across the whole row, and the local attention spec takes no
packed_seq_params); right padding never leaks into earlier tokens under a causal mask. This costs
O(S * L_max^2) attention memory instead of O(T^2) for a block-diagonal mask over the packed row.

A micro-step's gradient is always computed from zero, with normaliser 1, and returned as one flat
fp32 tensor; the caller (gyre/train/elastic.py) adds micro-steps in index order, which makes the
step independent of which cell computed which micro-step, and divides the sum by the step's total
loss weight once (`apply_gradient`): the loss is linear in 1 / normaliser, so a streaming step can
start before it knows the normaliser.
"""

import time
from collections import Counter

import torch
import torch.distributed as dist

from gyre.models.config import ModelConfig
from gyre.models.convert import megatron_to_engine
from gyre.train.batch import check_structure, screen_batch
from gyre.train.config import TrainerConfig
from gyre.train.loss import finish_stats, merge_stats, policy_loss
from gyre.train.model import FlatParams, build_gpt_model, init_distributed, load_full_weights
from gyre.trajectory.sample import PackedBatch


class Trainer:
    """The policy model, its flat weight/gradient buffers and its optimizer, on one cell rank."""

    def __init__(self, model_cfg: ModelConfig, cfg: TrainerConfig, seed: int = 0):
        init_distributed(cfg.tensor_parallel_size, seed, cfg.collective_timeout_s)
        torch.manual_seed(seed)  # CPU initialisation draws from the default generator
        self.model_cfg, self.cfg = model_cfg, cfg
        self.cuda = torch.cuda.is_available()
        self.model = build_gpt_model(model_cfg, cfg)
        if self.cuda:
            self.model.cuda()
        self.flat = FlatParams.adopt(self.model)
        self.grad = torch.zeros_like(self.flat.weights)
        self.optimizer = _make_optimizer(self.flat.params, cfg)
        self.step = 0
        self._host: list[tuple[torch.UntypedStorage, torch.Tensor]] | None = None
        """While offloaded: each moved storage with its host copy."""

    @property
    def local_optimizer(self) -> torch.optim.Optimizer:
        """The AdamW holding this rank's optimizer state (its share of the parameters, under data parallel)."""
        return getattr(self.optimizer, "optim", self.optimizer)

    # ---- forward -------------------------------------------------------------------------
    def _forward(self, batch: PackedBatch, need_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token log-probs [T] (0 at each sequence start) and optionally entropies [T]."""
        from megatron.core import tensor_parallel

        device = self.flat.weights.device
        cu = batch.cu_seqlens.tolist()
        lengths = [b - a for a, b in zip(cu, cu[1:])]
        L = max(lengths)
        ids = torch.zeros(len(lengths), L, dtype=torch.long)
        for i, (a, n) in enumerate(zip(cu, lengths)):
            ids[i, :n] = batch.tokens[a : a + n]
        ids = ids.to(device)
        pos = torch.arange(L, device=device).expand(len(lengths), L)
        # The local spec builds its default causal mask on "cuda"; on CPU we pass it (True = masked).
        mask = None if self.cuda else torch.triu(torch.ones(L, L, dtype=torch.bool), 1)[None, None]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.cuda and self.cfg.bf16):
            logits = self.model(ids, pos, mask)  # [S, L, V / tp]
        logits = logits[:, :-1].float()
        token_lp = -tensor_parallel.vocab_parallel_cross_entropy(
            logits.transpose(0, 1).contiguous(), ids[:, 1:].t().contiguous()
        ).t()
        entropy = None
        if need_entropy:
            full = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
            logp = torch.log_softmax(full, dim=-1)
            entropy = -(logp.exp() * logp).sum(-1)
        return self._repack(token_lp, cu, lengths), (self._repack(entropy, cu, lengths) if need_entropy else None)

    @staticmethod
    def _repack(per_seq: torch.Tensor, cu: list[int], lengths: list[int]) -> torch.Tensor:
        parts = []
        for i, n in enumerate(lengths):
            parts.append(torch.zeros(1, dtype=per_seq.dtype, device=per_seq.device))
            parts.append(per_seq[i, : n - 1])
        return torch.cat(parts).cpu() if per_seq.is_cuda else torch.cat(parts)

    @torch.no_grad()
    def logprobs(self, batch: PackedBatch) -> torch.Tensor:
        """Log-prob [T] of each token under the current weights (0 at each sequence start)."""
        self.model.eval()
        return self._forward(batch, need_entropy=False)[0]

    # ---- micro-steps and steps --------------------------------------------------------------
    def microstep(self, batch: PackedBatch, normaliser: float = 1.0) -> tuple[torch.Tensor, dict[str, float]]:
        """Gradient of one micro-batch's share of the step loss, in the flat buffer `self.grad`.

        Args:
            normaliser: total loss weight of the whole step (see gyre/train/loss.py); steps pass 1
                and divide the summed gradient instead (`apply_gradient`).
        Returns:
            (self.grad, stats); the buffer is overwritten by the next call.
        Raises:
            BatchError: the batch is structurally unusable (run `prepare_step` first to drop bad sequences).
        """
        check_structure(batch, self.model_cfg.vocab_size)
        self.model.train()
        for p in self.flat.params:
            p.grad = None
        need_entropy = self.cfg.entropy_coef > 0
        lp, ent = self._forward(batch, need_entropy)
        loss, stats = policy_loss(
            lp,
            batch.behaviour_logprobs,
            batch.advantages,
            batch.loss_weights,
            batch.target_mask,
            normaliser,
            self.cfg,
            ent,
        )
        loss.backward()
        stats["num_tokens"] = batch.num_tokens
        return self.flat.gather_grads(self.grad), stats

    def apply_gradient(self, grad: torch.Tensor, normaliser: float = 1.0) -> dict[str, float]:
        """One optimizer step with the summed flat gradient divided by `normaliser` (the step's
        total loss weight; in place); bumps `self.step` (the weight version)."""
        if normaliser != 1.0:
            grad.div_(normaliser)
        self.flat.set_grads(grad)
        norm = self._grad_norm()
        if self.cfg.max_grad_norm > 0 and norm > self.cfg.max_grad_norm:
            grad.mul_(self.cfg.max_grad_norm / (norm + 1e-6))
        for group in self.optimizer.param_groups:
            group["lr"] = self.cfg.lr_at(self.step)
        self.optimizer.step()
        for p in self.flat.params:
            p.grad = None
        self.step += 1
        return {"grad_norm": norm, "lr": self.optimizer.param_groups[0]["lr"]}

    # ---- the device belongs to the cell's role ----------------------------------------------
    @property
    def offloaded(self) -> bool:
        return self._host is not None

    def _resident(self) -> list[torch.UntypedStorage]:
        """The storages the trainer keeps between steps: its flat weights and its optimizer state."""
        state = [t for s in self.local_optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        storages = {id(t.untyped_storage()): t.untyped_storage() for t in [self.flat.weights, *state]}
        return [s for s in storages.values() if s.nbytes()]

    def offload(self) -> None:
        """Give the device to the engine while the cell serves: the weights and the optimizer state
        move to host memory (pinned on CUDA), the gradient buffer (scratch between micro-steps) is
        freed; every tensor and view keeps its identity, its storage empty until `onload`."""
        if self._host is not None:
            return
        self._host = move_to_host(self._resident(), pin=self.cuda)
        self.grad.untyped_storage().resize_(0)
        if self.cuda:
            torch.cuda.empty_cache()  # to the driver: the engine takes it back

    def onload(self) -> None:
        """The state back on the device (new addresses: registrations are the caller's), bit for bit."""
        if self._host is None:
            return
        move_back(self._host)
        self.grad.untyped_storage().resize_(self.grad.numel() * self.grad.element_size())
        self.grad.zero_()
        self._host = None

    def skip_step(self) -> None:
        """A step with nothing to train: the version moves on (the lr schedule with it), the weights stay."""
        self.step += 1

    def _grad_norm(self) -> float:
        """Global L2 norm: TP-sharded parameters summed over the TP group, replicated ones once."""
        from megatron.core import parallel_state

        device = self.flat.weights.device  # the TP group's (NCCL reduces only CUDA tensors)
        sharded = torch.zeros((), dtype=torch.float64, device=device)
        replicated = torch.zeros((), dtype=torch.float64, device=device)
        for p in self.flat.params:
            sq = p.grad.double().pow(2).sum()
            if getattr(p, "tensor_model_parallel", False):
                sharded += sq
            else:
                replicated += sq
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            dist.all_reduce(sharded, group=parallel_state.get_tensor_model_parallel_group())
        return float((sharded + replicated).sqrt())

    def train_step(self, batches: list[PackedBatch]) -> dict[str, float]:
        """One optimizer step over `batches` by this cell alone (every rank passes the same list)."""
        batches, normaliser, excluded = prepare_step(batches, self.model_cfg.vocab_size)
        metrics, _ = self.step_screened(batches, normaliser)
        return dict(excluded) | metrics

    def step_screened(self, batches: list[PackedBatch], normaliser: float) -> tuple[dict, list[tuple]]:
        """One optimizer step over screened `batches` on every rank of the cell (each passes the same list).

        Returns:
            (loss metrics, grad norm and lr; [(seconds, unix time it ended, global rank)] per micro-step)
        """
        total, per = self.fold(batches)
        stats = {}
        for st, *_ in per:
            stats = merge_stats(stats, st)
        return finish_stats(stats) | self.apply_gradient(total, normaliser), [tuple(p[1:]) for p in per]

    def fold(self, batches: list[PackedBatch]) -> tuple[torch.Tensor, list[tuple[dict, float, float, int]]]:
        """The summed gradient of `batches`, added in index order whatever the data-parallel split,
        so the sum is bitwise the one-rank sum (the elastic core's contract).

        Data-parallel rank r computes micro-steps r, r + DP, ...; each round the DP ranks broadcast
        their gradient in rank order and every rank adds them in index order (one flat gradient per
        micro-step crosses the group, not one all-reduce per step: the price of bitwise sums).

        Returns:
            (summed flat gradient, [(stats, seconds, unix time it ended, global rank)] per micro-step)
        """
        from megatron.core import parallel_state

        dp, me = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
        group = parallel_state.get_data_parallel_group() if dp > 1 else None
        total, other = torch.zeros_like(self.flat.weights), torch.empty_like(self.flat.weights)
        mine = []
        for first in range(0, len(batches), dp):
            if first + me < len(batches):
                t0 = time.perf_counter()
                grad, stats = self.microstep(batches[first + me])
                mine.append((stats, time.perf_counter() - t0, time.time(), dist.get_rank()))
            for owner in range(min(dp, len(batches) - first)):
                g = self.grad if owner == me else other
                if dp > 1:
                    dist.broadcast(g, src=dist.get_global_rank(group, owner), group=group)
                total.add_(g)
        if dp == 1:
            return total, mine
        gathered = [None] * dp
        dist.all_gather_object(gathered, mine, group=group)
        return total, [gathered[i % dp][i // dp] for i in range(len(batches))]

    # ---- weights for engines ---------------------------------------------------------------
    def engine_weights(self, to_first: bool = False) -> dict[str, torch.Tensor]:
        """The current weights under engine (HF/Qwen2) names, full host tensors in the dtype engines
        load (bf16 on CUDA), on every TP rank; with `to_first` on the tensor-parallel group's first
        rank only (the others gather to it and return {}: one host copy of the model, not one a rank).

        With TP > 1 each sharded parameter is gathered along its partition dimension; fc1's shards
        are [gate_r; up_r] per rank, so gates and ups are regrouped before conversion.
        """
        from megatron.core import parallel_state

        from gyre.train.publish import served_dtype

        state = {n: self._full_tensor(n, p.detach(), to_first) for n, p in self.model.named_parameters()}
        if to_first and parallel_state.get_tensor_model_parallel_rank() != 0:
            return {}
        dtype = served_dtype(self.cuda)
        return megatron_to_engine({n: t.to(dtype).cpu() for n, t in state.items()}, self.model_cfg)

    def _full_tensor(self, name: str, local: torch.Tensor, to_first: bool = False) -> torch.Tensor:
        from megatron.core import parallel_state

        tp = parallel_state.get_tensor_model_parallel_world_size()
        param = dict(self.model.named_parameters())[name]
        if tp == 1 or not getattr(param, "tensor_model_parallel", False):
            return local
        group, first = (
            parallel_state.get_tensor_model_parallel_group(),
            parallel_state.get_tensor_model_parallel_rank() == 0,
        )
        shards = [torch.empty_like(local) for _ in range(tp)] if first or not to_first else None
        if to_first:
            dist.gather(local.contiguous(), shards, group=group, group_dst=0)
            if not first:
                return local
        else:
            dist.all_gather(shards, local.contiguous(), group=group)
        if name.endswith("mlp.linear_fc1.weight"):
            halves = [s.chunk(2, dim=0) for s in shards]
            return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        return torch.cat(shards, dim=param.partition_dim)

    def load_engine_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Overwrite the weights from full engine-named tensors, each TP rank its shard."""
        load_full_weights(self.model, self.model_cfg, tensors)


def _make_optimizer(params: tuple[torch.nn.Parameter, ...], cfg: TrainerConfig) -> torch.optim.Optimizer:
    """AdamW; under data parallel its state is sharded over the replicas (ZeRO stage 1): whole
    parameters are dealt out by size, each replica steps its own and broadcasts them after the
    step. Each parameter's update is the same per-parameter arithmetic as unsharded, so the
    weights stay bit for bit those of one rank, and each rank holds ~1/DP of Adam's moments."""
    from megatron.core import parallel_state
    from torch.distributed.optim import ZeroRedundancyOptimizer

    kwargs = dict(
        lr=cfg.lr,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
        weight_decay=cfg.weight_decay,
        foreach=False,  # per-parameter loop: the same arithmetic on every cell, bit for bit
    )
    if parallel_state.get_data_parallel_world_size() == 1:
        return torch.optim.AdamW(params, **kwargs)
    group = parallel_state.get_data_parallel_group()
    return ZeroRedundancyOptimizer(params, torch.optim.AdamW, process_group=group, **kwargs)


def prepare_step(batches: list[PackedBatch], vocab_size: int) -> tuple[list[PackedBatch], float, dict[str, float]]:
    """Screen a step's micro-batches and compute the token-level normaliser over what remains.

    Returns:
        (screened batches, total loss weight of their targets, {"excluded/<reason>": count})
    Raises:
        BatchError: a structurally broken batch, or one with no trainable sequence left.
    """
    screened, excluded = [], Counter()
    for b in batches:
        kept, counts, _ = screen_batch(b, vocab_size)
        screened.append(kept)
        excluded.update(counts)
    total = sum(float(b.loss_weights[b.target_mask].sum()) for b in screened)
    return screened, total, {f"excluded/{r}": n for r, n in excluded.items()}


def move_to_host(storages: list[torch.UntypedStorage], pin: bool) -> list[tuple[torch.UntypedStorage, torch.Tensor]]:
    """Copy each storage to host memory (pinned: fast copies back to a GPU), then empty it. Returns
    what `move_back` restores."""
    host = []
    for storage in storages:
        copy = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
        copy.untyped_storage().copy_(storage)
        host.append((storage, copy))
        storage.resize_(0)
    return host


def move_back(host: list[tuple[torch.UntypedStorage, torch.Tensor]]) -> None:
    """Refill each storage `move_to_host` emptied from its host copy."""
    for storage, copy in host:
        storage.resize_(copy.numel())
        storage.copy_(copy.untyped_storage())
