"""The weight group between a trainer and one SGLang engine's TP ranks, joined the same way from
either side (the core's weight sender as rank 0; SGLang, or its contract fake, at its rank offset)."""

from datetime import timedelta

import torch.distributed as dist


def join_weight_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float = 300.0,
) -> dist.ProcessGroup:
    """Join (rank 0 hosts the store) the weight group of a trainer and one engine's TP ranks.

    SGLang's side (`sglang.srt.utils.init_custom_process_group`, called by its
    `/init_weights_update_group`) rendezvouses at tcp://master_address:master_port, keeps the group's
    keys under `group_name` and builds a group beside the default one; this is the same
    construction, for either side. torch has no public call for a second, separately rendezvoused
    group, hence the c10d helpers SGLang itself uses. Blocks until all `world_size` ranks joined.
    """
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(
        rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), PrefixStore(group_name, store), group_name=group_name, timeout=timeout
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group
