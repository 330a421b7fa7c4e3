"""Engine pure parts: the paged prefix cache and the transfer arena its imports live in, /generate
parsing, weight-version spans, the SGLang command line (golden), and EngineConfig validation."""

import dataclasses

import pytest
import torch
from omegaconf import OmegaConf

from gyre.engines.config import EngineConfig
from gyre.engines.launch import advertised_url, make_sglang_command, make_sglang_env
from gyre.engines.prefix_cache import CacheFull, PrefixCache, PrefixMissing
from gyre.engines.protocol import BadRequest, parse_generate
from gyre.errors import ConfigError
from gyre.transfer import BufferLayout, TransferArena


def _kv(n: int) -> torch.Tensor:
    return torch.arange(2 * 2 * n * 3, dtype=torch.float32).view(1, 2, n, 3, 2)


def _held(cache: PrefixCache, namespace: tuple, tokens: list[int]) -> int:
    """Tokens of `tokens`' longest cached prefix (a match's pieces, summed)."""
    return sum(p.shape[2] for p in cache.match(namespace, tokens))


def test_prefix_cache_matches_page_aligned_prefixes_per_namespace():
    cache = PrefixCache(page_size=4, capacity_tokens=64)
    toks = list(range(10))
    assert cache.insert(("v0", None), toks, _kv(10)) == 2  # only full pages
    (piece,) = cache.match(("v0", None), toks + [99])  # the insert copied its pages into one buffer
    assert torch.equal(piece, _kv(10)[:, :, :8])
    assert _held(cache, ("v0", None), [0, 1, 2, 3, 9, 9, 9, 9]) == 4  # diverges in page 2
    assert cache.match(("v1", None), toks) == []  # other weights: never reused
    assert cache.match(("v0", "other-key"), toks) == []
    assert cache.insert(("v0", None), toks, _kv(10)) == 0  # already there
    imported = _kv(10)
    cache.insert(("v2", None), toks, imported, copy=False)  # one buffer's slots: one piece, a view of it
    (piece,) = cache.match(("v2", None), toks)
    assert piece.data_ptr() == imported.data_ptr() and torch.equal(piece, imported[:, :, :8])


def test_prefix_cache_evicts_least_recently_used_leaves_first():
    cache = PrefixCache(page_size=2, capacity_tokens=8)  # 4 pages
    cache.insert(("v",), [1, 2, 3, 4, 5, 6], _kv(6))  # 3 pages
    cache.insert(("v",), [7, 8, 9, 10], _kv(4))  # 2 pages -> one evicted: the oldest leaf, 5 6
    assert cache.num_tokens == 8
    assert _held(cache, ("v",), [1, 2, 3, 4, 5, 6]) == 4
    assert _held(cache, ("v",), [7, 8, 9, 10]) == 4


def test_moved_kv_is_pinned_until_its_session_uses_it_and_a_full_cache_refuses_more():
    cache = PrefixCache(page_size=2, capacity_tokens=8)  # 4 pages
    cache.insert(("v",), [1, 2, 3, 4], _kv(4), pin=True)  # a moved session: 2 pinned pages
    cache.insert(("v",), [5, 6, 7, 8, 9, 10], _kv(6))  # 3 ordinary pages: one of them is evicted, no pinned one
    assert _held(cache, ("v",), [5, 6, 7, 8, 9, 10]) == 4 and cache.num_tokens == 8  # its leaf went
    with pytest.raises(CacheFull, match="room for 4 more pinned tokens, the import needs 6"):
        cache.insert(("v",), [11, 12, 13, 14, 15, 16], _kv(6), pin=True)
    assert cache.insert(("v",), [11, 12, 13, 14], _kv(4), pin=True) == 2  # fits beside the pinned 2
    assert _held(cache, ("v",), [1, 2, 3, 4]) == 4  # the session's next call: unpinned from now on
    cache.insert(("v",), [21, 22, 23, 24], _kv(4))
    assert cache.match(("v",), [1, 2]) == [] and _held(cache, ("v",), [11, 12, 13, 14]) == 4


def test_an_insert_copies_its_new_pages_into_one_allocated_buffer():
    made = []
    cache = PrefixCache(
        page_size=2,
        capacity_tokens=16,
        allocate=lambda shape, dtype: made.append(shape) or torch.empty(shape, dtype=dtype),
    )
    kv = _kv(9)
    cache.insert(("v",), [1, 2, 3, 4], kv[:, :, :4])
    cache.insert(("v",), [1, 2, 3, 4, 5, 6, 7, 8, 9], kv)  # pages 3 and 4 are new: one buffer of 4 tokens
    assert made == [(1, 2, 4, 3, 2), (1, 2, 4, 3, 2)]
    pieces = cache.match(("v",), list(range(1, 10)))
    assert len(pieces) == 2 and torch.equal(torch.cat(pieces, 2), kv[:, :, :8])


def test_a_chains_tail_is_inserted_after_its_head_and_refused_without_it():
    cache = PrefixCache(page_size=2, capacity_tokens=16)
    toks = list(range(10))
    kv = _kv(10)
    cache.insert(("v",), toks[:4], kv[:, :, :4], pin=True, copy=False)  # a call's prompt, moved first
    assert cache.insert(("v",), toks, kv[:, :, 4:], pin=True, copy=False, kv_from_page=2) == 3  # its tail
    assert torch.equal(torch.cat(cache.match(("v",), toks), 2), kv[:, :, :10])
    with pytest.raises(PrefixMissing, match="page 0 of the chain is not cached"):
        cache.insert(("v",), [7] * 6, _kv(2), kv_from_page=2)


def test_eviction_takes_the_least_recently_used_unpinned_pages_of_a_thousand():
    """Eviction is a pop from an ordered dict: a thousand-page cache evicts the same pages a
    sort by last use would."""
    cache = PrefixCache(page_size=1, capacity_tokens=1000)
    for i in range(1000):
        cache.insert(("v",), [i], _kv(1))
    cache.match(("v",), [0])  # page 0 becomes the newest
    cache.insert(("v",), [5000, 5001], _kv(2))  # two pages in: the two oldest (1, 2) out
    assert [_held(cache, ("v",), [t]) for t in (0, 1, 2, 3)] == [1, 0, 0, 1] and cache.num_tokens == 1000


def test_an_imported_buffer_returns_to_the_arena_once_its_last_page_is_evicted():
    arena = TransferArena(2 * 4096)
    layout = BufferLayout.for_tensors({"kv": _kv(8)})
    kv = layout.unpack(arena.take(layout.nbytes))["kv"]  # what import_kv_pages reads into
    cache = PrefixCache(page_size=2, capacity_tokens=8)
    cache.insert(("v",), list(range(8)), kv, copy=False)
    del kv
    held = cache.match(("v",), [0, 1])  # a match's view (an export copying it) holds the buffer too
    cache.insert(("v",), list(range(10, 18)), _kv(8))  # evicts every page of the import
    assert cache.match(("v",), [0, 1]) == [] and arena.free_bytes == 4096
    del held
    assert arena.free_bytes == 2 * 4096


OK = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}


@pytest.mark.parametrize(
    "body, match",
    [
        pytest.param({}, "missing input_ids", id="no-input"),
        pytest.param({"input_ids": []}, "empty", id="empty-input"),
        pytest.param({"input_ids": [1, 600]}, "outside the vocabulary", id="id-too-big"),
        pytest.param({"input_ids": [-1]}, "outside the vocabulary", id="negative-id"),
        pytest.param({"input_ids": ["a"]}, "list of integers", id="string-ids"),
        pytest.param({"input_ids": [[1], [2]]}, "batched", id="batched"),
        pytest.param({**OK, "sampling_params": {"max_new_tokens": 510}}, "context window", id="beyond-context"),
        pytest.param({**OK, "sampling_params": {"temperature": -1}}, "temperature", id="negative-temperature"),
        pytest.param({**OK, "sampling_params": {"top_p": 0}}, "top_p", id="zero-top-p"),
        pytest.param({**OK, "sampling_params": {"max_new_tokens": 1.5}}, "integer", id="float-max-new"),
        pytest.param({**OK, "sampling_params": {"sampling_seed": "x"}}, "sampling_seed", id="string-seed"),
        pytest.param({**OK, "sampling_params": []}, "object", id="params-not-object"),
        pytest.param({"text": "hi"}, "no tokenizer", id="text-without-tokenizer"),
    ],
)
def test_bad_generate_bodies_name_the_field(body, match):
    with pytest.raises(BadRequest, match=match):
        parse_generate(body, vocab_size=512, context_len=512)


def test_generate_body_defaults_and_unknown_fields():
    g = parse_generate(
        {**OK, "whatever": 1, "sampling_params": {"max_new_tokens": 4, "n": 1, "sampling_seed": 7}}, 512, 512
    )
    assert g.params.max_new_tokens == 4 and g.params.seed == 7 and g.params.temperature == 1.0 and not g.stream
    assert parse_generate({"text": "ab"}, 512, 512, encode=lambda t: list(t.encode())).input_ids == [97, 98]


def test_one_span_type_and_one_version_parser_for_wire_records_and_batching():
    from gyre.records.versions import (
        VersionSpan,
        WeightVersionError,
        make_version_spans,
        parse_weight_version,
        versions_between,
    )

    spans = make_version_spans([1, 1, 2, 2, 2])
    wire = [s.to_wire() for s in spans]
    assert wire == [{"weight_version": 1, "start": 0, "end": 2}, {"weight_version": 2, "start": 2, "end": 5}]
    assert make_version_spans([]) == () and [VersionSpan.from_wire(w) for w in wire] == list(spans)
    assert versions_between(list(spans), 1, 4) == [1, 2, 2]
    assert [parse_weight_version(v) for v in (3, "12", 0)] == [3, 12, 0]
    for bad in ("-1", -1, "default", None, True, 1.5, "7b"):
        with pytest.raises(WeightVersionError, match="weight_version must be an integer >= 0"):
            parse_weight_version(bad)


def test_sglang_command_golden():
    cfg = EngineConfig(
        backend="sglang",
        model_path="/models/qwen",
        mooncake_master="10.0.0.1:50051",
        weight_version=7,
        weight_sync="distributed",
    )
    assert make_sglang_command(cfg, 30001, python="python") == [
        "python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/models/qwen",
        "--host",
        "127.0.0.1",
        "--port",
        "30001",
        "--tp-size",
        "1",
        "--base-gpu-id",
        "0",
        "--mem-fraction-static",
        "0.85",
        "--page-size",
        "16",
        "--load-format",
        "auto",
        "--weight-version",
        "7",
        "--enable-memory-saver",
        "--enable-hierarchical-cache",
        "--hicache-ratio",
        "2.0",
        "--hicache-write-policy",
        "write_through",
        "--hicache-storage-backend",
        "mooncake",
    ]
    env = make_sglang_env(cfg, {"PATH": "/bin"})
    assert env["MOONCAKE_MASTER"] == "10.0.0.1:50051" and env["PATH"] == "/bin"
    assert env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "0"  # the proxy's probes never generate
    assert env["MOONCAKE_PROTOCOL"] == "tcp" and env["MOONCAKE_DEVICE"] == ""  # transfer.* defaults
    site = {"GYRE_TRANSFER_PROTOCOL": "rdma", "GYRE_TRANSFER_DEVICE": "mlx5_0,mlx5_1"}  # the run's transfer.*
    env = make_sglang_env(cfg, site)
    assert env["MOONCAKE_PROTOCOL"] == "rdma" and env["MOONCAKE_DEVICE"] == "mlx5_0,mlx5_1"
    plain = EngineConfig(
        backend="sglang", model_path="/m", enable_hicache=False, weight_sync="disk", extra_args=["--disable-cuda-graph"]
    )
    cmd = make_sglang_command(plain, 1)
    assert "--enable-hierarchical-cache" not in cmd and cmd[-1] == "--disable-cuda-graph"
    fake = make_sglang_command(plain, 1, python="python", base_gpu_id=2, module="gyre.engines.sglang_fake")
    assert fake[:3] == ["python", "-m", "gyre.engines.sglang_fake"] and fake[fake.index("--base-gpu-id") + 1] == "2"


SG = {"backend": "sglang", "model_path": "/m", "enable_hicache": False, "weight_sync": "disk"}


def test_a_server_spanning_nodes_gets_its_node_rank_and_rendezvous_and_binds_apart_from_its_url():
    """engine.nnodes > 1: --nnodes, --node-rank, --dist-init-addr (one process per node, SGLang
    0.5.21's srt/arg_groups/fields/parallel.py); --host is the bind address, the URL the proxy dials
    is engine.host."""
    cfg = EngineConfig(**SG, tp_size=8, nnodes=2, node_rank=1, dist_init_addr="10.0.0.5:29500", bind_host="0.0.0.0")
    cmd = make_sglang_command(cfg, 30001, python="python")
    flags = {cmd[i]: cmd[i + 1] for i in range(3, len(cmd) - 1) if cmd[i].startswith("--")}
    assert flags["--nnodes"] == "2" and flags["--node-rank"] == "1" and flags["--dist-init-addr"] == "10.0.0.5:29500"
    assert flags["--host"] == "0.0.0.0" and flags["--tp-size"] == "8"
    assert advertised_url(dataclasses.replace(cfg, host="10.0.0.6"), 30001) == "http://10.0.0.6:30001"
    one_node = make_sglang_command(EngineConfig(**SG), 1)
    assert "--nnodes" not in one_node and one_node[one_node.index("--host") + 1] == "127.0.0.1"  # as before
    with pytest.raises(ValueError, match="dist_init_addr"):
        make_sglang_command(EngineConfig(**SG, tp_size=2, nnodes=2), 1)


def test_the_sglang_fake_takes_the_command_line_gyre_gives_sglang():
    """The fake parses exactly make_sglang_command's flags (as sglang.launch_server would) and refuses
    others and TP it cannot serve, so a run with engine.sglang_fake starts it as it starts SGLang."""
    from gyre.engines.sglang_fake import parse_args

    cfg = EngineConfig(
        backend="sglang", model_path="/m", mooncake_master="h:1", weight_version=3, weight_sync="disk", sglang_fake=True
    )
    a = parse_args(make_sglang_command(cfg, 4242)[3:])
    assert (a.model_path, a.port, a.weight_version, a.enable_hierarchical_cache) == ("/m", 4242, "3", True)
    spanning = ["--model-path", "/m", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "h:1"]
    for argv in (["--model-path", "/m", "--no-such-flag"], ["--model-path", "/m", "--tp-size", "2"], spanning):
        with pytest.raises(SystemExit):
            parse_args(argv)


@pytest.mark.parametrize(
    "kwargs, key",
    [
        pytest.param({"backend": "vllm"}, "backend", id="unknown-backend"),
        pytest.param({"backend": "sglang", "weight_sync": "disk"}, "model_path", id="sglang-needs-model"),
        pytest.param(
            {"backend": "sglang", "model_path": "/m", "weight_sync": "disk"},
            "mooncake_master",
            id="hicache-needs-store",
        ),
        pytest.param({"max_running_requests": 0}, "max_running_requests", id="no-batch"),
        pytest.param({"kv_arena_mib": -1}, "kv_arena_mib", id="negative-arena"),
        pytest.param({"mem_fraction_static": 1.5}, "mem_fraction_static", id="mem-fraction"),
        pytest.param({"weight_sync": "rsync"}, "weight_sync", id="unknown-weight-sync"),
        pytest.param({"pause_mode": "hold"}, "pause_mode", id="unknown-pause-mode"),
        pytest.param(
            {"backend": "sglang", "model_path": "/m", "enable_hicache": False},
            "weight_sync",
            id="sglang-cannot-read-mooncake",
        ),
        pytest.param({"sglang_fake": True}, "sglang_fake", id="fake-without-sglang"),
        pytest.param({"host": "0.0.0.0"}, "host", id="wildcard-advertised"),
        pytest.param({"nnodes": 2, "tp_size": 2}, "nnodes", id="builtin-spans-nodes"),
        pytest.param({**SG, "nnodes": 2, "tp_size": 3}, "nnodes", id="tp-not-shared-by-nodes"),
        pytest.param({**SG, "nnodes": 0}, "nnodes", id="no-nodes"),
        pytest.param({**SG, "nnodes": 2, "tp_size": 2, "node_rank": 2}, "node_rank", id="node-rank-beyond"),
    ],
)
def test_engine_config_names_bad_keys(kwargs, key):
    with pytest.raises(ConfigError) as err:
        EngineConfig(**kwargs)
    assert err.value.key == key


def test_an_unknown_weight_sync_lists_the_valid_ones():
    with pytest.raises(ConfigError, match=r"\['mooncake', 'distributed', 'disk'\], got 'rsync'"):
        EngineConfig(weight_sync="rsync")


def test_engine_group_composes_for_both_backends():
    from gyre.config import validate
    from tests.unit.test_config import compose

    assert validate(compose()).engine.backend == "builtin"
    sglang = compose("engine=sglang", "engine.model_path=/models/q", "engine.mooncake_master=10.0.0.1:50051")
    sg = OmegaConf.to_object(sglang.engine)
    assert sg.backend == "sglang" and sg.enable_hicache and sg.page_size == 64
    assert sg.weight_sync == "distributed" and not sg.sglang_fake and sg.pause_mode == "retract"
    with pytest.raises(ConfigError) as err:  # a valid engine group, but sglang is not installed here
        validate(sglang)
    assert err.value.key == "engine.backend"
    faked = validate(
        compose("engine=sglang", "engine.model_path=/m", "engine.enable_hicache=false", "engine.sglang_fake=true")
    )
    assert faked.engine.backend == "sglang" and faked.engine.sglang_fake
    with pytest.raises(ConfigError) as err:
        validate(compose("engine.max_running_requests=0"))
    assert err.value.key == "engine.max_running_requests"


def test_a_server_that_cannot_start_reports_its_log(tmp_path):
    from gyre.engines.launch import BuiltinEngineProcess, EngineLaunchError
    from gyre.models.config import ModelConfig

    proc = BuiltinEngineProcess(EngineConfig(model_path=str(tmp_path / "missing"), startup_timeout_s=60), ModelConfig())
    with pytest.raises(EngineLaunchError, match="config.json"):
        proc.start()
    assert proc.proc.poll() is not None
