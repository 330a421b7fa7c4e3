"""The simulator drives the real policy objects; its configs fail at config time naming the key."""

import json
import subprocess
import sys
from dataclasses import replace

import hydra
import pytest

from gyre.common import CONF_DIR
from gyre.config import validate
from gyre.errors import ConfigError
from gyre.scheduler.config import SchedulerConfig
from gyre.sim.config import PresetConfig, ProfileConfig, SimConfig
from gyre.sim.engine import Simulation
from gyre.sim.result import critical_path_s, ideal_lower_bound_s, startup_bound_s
from gyre.sim.workload import draw_batch

PROFILE = ProfileConfig(
    groups_per_step=4,
    group_size=4,
    segments_median=6,
    segments_sigma=0.8,
    gen_tokens_median=600,
    tool_s_median=20,
    context_tokens_per_segment=2000,
    timeout_s=900,
    excluded_fraction=0.1,
)
PRESET = PresetConfig(
    num_nodes=4,
    num_cells=4,
    kv_tokens_per_node=400_000,
    max_sessions_per_node=16,
    gen_tok_s_per_node=400,
    session_tok_s=50,
    train_tok_s_per_node=500,
    optimizer_step_s=5,
)


def simulate(mode: str, staleness: int = 1, **kw):
    return Simulation(
        PROFILE, PRESET, SchedulerConfig(mode=mode, staleness=staleness), num_steps=4, tick_s=5.0, **kw
    ).run()


@pytest.mark.parametrize("mode", ["elastic", "async", "colocate"])
@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_every_mode_finishes_within_the_staleness_bound(mode, staleness):
    r = simulate(mode, staleness)
    assert len(r.step_times_s) == 4 and r.step_times_s == sorted(r.step_times_s)
    assert r.max_staleness <= staleness
    ideal = ideal_lower_bound_s([r])
    assert r.total_s >= ideal > 0 and r.total_s >= r.critical_path_s > 0
    if mode != "colocate":  # only colocate parks live executions while every cell trains
        assert r.num_blocked == 0


@pytest.mark.parametrize(
    "groups, s, opt, expected",
    [
        pytest.param([[(100, 0)]] * 3, 0, 10, 330, id="on-policy-serial"),
        pytest.param([[(100, 0)]] * 3, 1, 10, 220, id="one-ahead-overlaps"),
        pytest.param([[(100, 0)], [(5, 0)], [(5, 0)]], 1, 10, 130, id="short-batches-wait-for-the-optimizer"),
        pytest.param([], 1, 10, 0, id="no-steps"),
        # training of a group starts once it is ready: 100 + 30, the early group's 20 s overlaps
        pytest.param([[(10, 20), (100, 30)]], 0, 10, 140, id="training-after-the-last-group"),
        # the early groups' training outlasts the late group's release: they queue on the cluster
        pytest.param([[(10, 80), (10, 40), (50, 5)]], 0, 10, 145, id="training-queues-behind-earlier-groups"),
        # step 1 is ready at 100 but trains only after step 0's optimizer step (100 + 50 + 10)
        pytest.param([[(100, 50)], [(100, 50)]], 1, 10, 220, id="a-step-trains-after-the-previous-optimizer-step"),
    ],
)
def test_critical_path_bound(groups, s, opt, expected):
    assert critical_path_s(groups, s, opt) == expected


def test_the_critical_path_counts_training_after_each_group_is_ready():
    fast = simulate("elastic")
    slow = Simulation(
        PROFILE, replace(PRESET, train_tok_s_per_node=50), SchedulerConfig(mode="elastic"), num_steps=4, tick_s=5.0
    ).run()
    # same executions, 10x slower training: training a group can start only once it is ready, so the
    # latency bound grows with it; neither run beats its own bound
    assert slow.critical_path_s > fast.critical_path_s
    assert slow.total_s >= slow.own_bound_s >= slow.critical_path_s and fast.total_s >= fast.own_bound_s


@pytest.mark.parametrize("mode", ["elastic", "colocate"])
def test_role_shares_cover_the_run_and_busy_fractions_are_fractions(mode):
    r = simulate(mode)
    for c in r.cells:
        roles = c.role_busy(r.total_s)
        assert sum(share for share, _ in roles.values()) == pytest.approx(1.0)
        assert all(0.0 <= busy <= 1.0 + 1e-9 for _, busy in roles.values())
        share, busy = roles.get("train", (0.0, 0.0))
        assert share * busy * r.total_s == pytest.approx(c.train_busy_s)
    if mode == "elastic":
        assert r.cells[0].role_busy(r.total_s)["train"][0] == 1.0  # the core never leaves training


@pytest.mark.parametrize(
    "first, train, rollout, first_rollout, expected",
    [
        pytest.param(0, 50, (30, 10), (0, 0), 80, id="no-wait-is-work-over-capacity"),
        pytest.param(20, 50, (30, 10), (5, 5), 95, id="only-the-first-batches-roll-out-while-nothing-trains"),
        pytest.param(20, 50, (30, 10), (25, 10), 80, id="the-wait-is-spent-on-their-rollout"),
        pytest.param(20, 50, (30, 40), (25, 30), 90, id="the-binding-rollout-resource-counts"),
    ],
)
def test_startup_bound(first, train, rollout, first_rollout, expected):
    assert startup_bound_s(first, train, rollout, first_rollout) == expected


def test_same_seed_same_result_and_modes_see_the_same_executions(monkeypatch):
    import gyre.sim.rollout

    drawn = []  # every batch of executions a run drew, in order

    def recording_draw(*args, **kw):
        drawn.append(draw_batch(*args, **kw))
        return drawn[-1]

    monkeypatch.setattr(gyre.sim.rollout, "draw_batch", recording_draw)
    a = simulate("elastic")
    elastic_batches, drawn[:] = list(drawn), []
    assert a == simulate("elastic")  # every figure, cell timeline and level sample
    assert drawn == elastic_batches and len(drawn) == 4
    drawn.clear()
    async_ = simulate("async")
    assert drawn == elastic_batches  # common random numbers: per execution, the same segments, tokens, tools
    assert async_.num_excluded == a.num_excluded


def test_elastic_switches_and_core_never_leaves_training():
    r = simulate("elastic")
    assert r.num_switches > 0
    core = r.cells[0]
    assert {role for _, role in core.timeline} == {"train"} and core.switches == 0


def test_switch_costs_are_charged():
    cheap = Simulation(
        PROFILE,
        PRESET,
        SchedulerConfig(mode="colocate", rollout_to_train_s=0, train_to_rollout_s=0),
        num_steps=4,
        tick_s=5.0,
    ).run()
    dear = Simulation(
        PROFILE,
        PRESET,
        SchedulerConfig(mode="colocate", rollout_to_train_s=300, train_to_rollout_s=300),
        num_steps=4,
        tick_s=5.0,
    ).run()
    assert dear.total_s > cheap.total_s + 4 * 300


def compose(*overrides):
    with hydra.initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return hydra.compose(config_name="sim", overrides=list(overrides))


@pytest.mark.parametrize(
    "override, key",
    [
        pytest.param("preset.num_cells=300", "preset.num_cells", id="more-cells-than-nodes"),
        pytest.param("preset.num_cells=5", "preset.num_cells", id="cells-do-not-divide-nodes"),
        pytest.param("preset.gen_tok_s_per_node=0", "preset.gen_tok_s_per_node", id="zero-decode-capacity"),
        pytest.param("preset.kv_tokens_per_node=0", "preset.kv_tokens_per_node", id="zero-kv-capacity"),
        pytest.param("scheduler.staleness=-1", "scheduler.staleness", id="negative-staleness"),
        pytest.param("scheduler.batching=greedy", "scheduler.batching", id="unknown-batching"),
        pytest.param("scheduler.async_split=oracle", "scheduler.async_split", id="unknown-async-split"),
        pytest.param("profile.group_size=0", "profile.group_size", id="empty-groups"),
        pytest.param("profile.timeout_s=0", "profile.timeout_s", id="no-time-budget"),
        pytest.param("modes=[elastic,sync]", "modes", id="unknown-mode"),
        pytest.param("lose_cell=6", "lose_cell", id="lose-a-cell-that-does-not-exist"),
    ],
)
def test_bad_presets_and_profiles_fail_naming_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        validate(compose(override), SimConfig)
    assert err.value.key == key


@pytest.mark.parametrize("profile", ["nl2repo", "deepswe", "terminalbench"])
@pytest.mark.parametrize("preset", ["qwen122b_24n", "qwen122b_32n", "qwen2t4_192n"])
def test_shipped_profiles_and_presets_validate(profile, preset):
    sim = validate(compose(f"profile={profile}", f"preset={preset}"), SimConfig)
    assert sim.profile.name == profile and sim.preset.name == preset


def test_cli_prints_tables_and_one_json_object_last(tmp_path):
    args = [
        "profile=terminalbench",
        "preset=qwen122b_24n",
        "num_steps=1",
        "profile.groups_per_step=8",
        "profile.group_size=4",
        "json=true",
        f"hydra.run.dir={tmp_path}",
    ]
    out = subprocess.run(
        [sys.executable, "-c", "from gyre.sim.app import main; main()", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    data = json.loads(lines[-1])
    assert set(data["modes"]) == {"elastic", "async", "colocate"} and data["ideal_h"] > 0
    assert "vs_async" in data["speedup"] and (tmp_path / "timeline.png").stat().st_size > 0
    assert any(line.startswith("elastic") for line in lines)


def test_cli_bad_preset_names_the_key(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "from gyre.sim.app import main; main()",
            "preset.num_cells=1000",
            f"hydra.run.dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0 and "preset.num_cells" in out.stderr


@pytest.mark.parametrize("mode", ["elastic", "async", "colocate"])
def test_a_lost_satellite_gets_no_work_and_the_run_finishes(mode):
    r = simulate(mode, losses=((1, 300.0),))
    assert len(r.step_times_s) == 4
    lost = r.cells[1]
    assert lost.timeline[-1] == (300.0, "lost") and lost.train_busy_s <= 300.0
    assert r.total_s >= simulate(mode).total_s * 0.99  # three cells are not faster than four


def test_losing_the_only_rollout_cell_of_async_brings_a_training_satellite_back_to_serve():
    sched = SchedulerConfig(mode="async", async_train_cells=3)
    r = Simulation(PROFILE, PRESET, sched, num_steps=4, tick_s=60.0, losses=((3, 100.0),)).run()
    assert len(r.step_times_s) == 4
    assert any(role == "rollout" for _, role in r.cells[1].timeline)


def test_losing_every_cell_but_the_core_stalls_loudly():
    with pytest.raises(RuntimeError, match="stalled"):
        Simulation(
            PROFILE,
            PRESET,
            SchedulerConfig(mode="async", async_train_cells=1),
            num_steps=4,
            tick_s=60.0,
            losses=((1, 100.0), (2, 100.0), (3, 100.0)),
        ).run()


def test_hand_back_replays_work_when_a_cell_leaves_mid_micro_step():
    # A tiny finish allowance forces hand-backs; the run still completes every step.
    sched = replace(SchedulerConfig(mode="elastic"), finish_microstep_max_s=0.0, min_dwell_s=0.0, leave_window_s=0.0)
    r = Simulation(PROFILE, PRESET, sched, num_steps=4, tick_s=5.0).run()
    assert len(r.step_times_s) == 4


@pytest.mark.parametrize("mode", ["elastic", "async", "colocate"])
def test_first_ready_steps_do_not_wait_for_stragglers_and_never_train_over_the_bound(mode):
    fixed, first = (
        Simulation(PROFILE, PRESET, SchedulerConfig(mode=mode, batching=b), num_steps=6, tick_s=5.0).run()
        for b in ("fixed", "first_ready")
    )
    assert fixed.masked_fraction == 0 and fixed.num_stale_dropped == 0  # a step waits for its own groups
    assert first.total_s < fixed.total_s and first.max_staleness <= 1
    # groups trained late keep only their spans inside the bound (some masked, or whole executions dropped)
    assert first.masked_fraction < 1 and (first.masked_fraction > 0 or first.num_stale_dropped > 0)


def test_the_offload_tier_is_pooled_whatever_the_roles():
    p = PresetConfig(num_nodes=4, num_cells=2, kv_tokens_per_node=1e6, host_kv_tokens_per_node=4e6)
    assert p.sessions_per_node(1e5) == 10 and p.pooled_sessions(1e5) == 160
    assert replace(p, host_kv_tokens_per_node=0).pooled_sessions(1e5) == 0
    # serving decode at long context: 10 calls' KV fit a node's GPUs, at 60 tokens/s each
    assert p.serving_tok_s_per_node(1e5) == 600 and p.serving_tok_s_per_node(1e3) == p.decode_tok_s_per_node


MECHANISM_SWITCHES = {
    "none": {},
    "value_leave": {"leave_rule": "value"},
    "rebalance": {"rebalance_on_return": True},
    "token_microsteps": {"microstep_tokens": 20_000},
    "staleness_admission": {"admission": "staleness"},
    "first_ready": {"batching": "first_ready"},
    "first_ready_early_admission": {"batching": "first_ready", "admission": "staleness"},
    "value_rebalance_microsteps": {"leave_rule": "value", "rebalance_on_return": True, "microstep_tokens": 20_000},
}


@pytest.mark.parametrize("mode", ["elastic", "async", "colocate"])
@pytest.mark.parametrize("mechanism", list(MECHANISM_SWITCHES))
def test_no_run_beats_the_tighter_bound_nor_exceeds_the_staleness_bound(mode, mechanism):
    from gyre.sim.result import tighter_bound_s

    sched = SchedulerConfig(mode=mode, **MECHANISM_SWITCHES[mechanism])
    r = Simulation(PROFILE, PRESET, sched, num_steps=4, tick_s=5.0).run()
    assert len(r.step_times_s) == 4 and r.max_staleness <= 1
    assert r.total_s >= tighter_bound_s([r]) > 0
    assert r.total_s >= r.work_node_s / r.num_nodes and r.total_s >= r.critical_path_s
    assert r.total_s >= r.startup_bound_s > 0


def test_early_admission_masks_the_spans_generated_before_the_version_it_trains_under():
    step, early = (
        Simulation(PROFILE, PRESET, SchedulerConfig(mode="elastic", admission=a), num_steps=6, tick_s=5.0).run()
        for a in ("step", "staleness")
    )
    assert step.masked_fraction == 0 and early.masked_fraction > 0 and early.max_staleness <= 1
    assert early.critical_path_s < step.critical_path_s


def test_derived_costs_follow_flops_and_measured_values_replace_them():
    from gyre.sim.cost import derive_costs, train_flops_per_token

    p = PresetConfig(
        active_params_b=10,
        attention_layers=12,
        attention_dim=8192,
        train_mfu=0.3,
        logprob_recompute=True,
        reference_pass=False,
    )
    # 4 passes x (2 x 10e9 + 2 x 12 x 8192 x 100k) FLOPs per token
    assert train_flops_per_token(p, 1e5) == pytest.approx(4 * (2e10 + 2 * 12 * 8192 * 1e5))
    assert train_flops_per_token(replace(p, reference_pass=True), 1e5) == pytest.approx(
        5 / 4 * train_flops_per_token(p, 1e5)
    )
    c = derive_costs(PROFILE, p, 0)
    peak = 8 * 989e12
    assert c.train_tok_s_per_node == pytest.approx(peak * 0.3 / train_flops_per_token(p, c.train_context_tokens))
    assert c.optimizer_step_s == pytest.approx(5 + 244 / 25)
    measured = derive_costs(PROFILE, replace(p, train_tok_s_per_node=1234.0, optimizer_step_s=7.0), 0)
    assert measured.train_tok_s_per_node == 1234.0 and measured.optimizer_step_s == 7.0


def test_measured_per_cell_throughputs_and_duration_samples_drive_the_run():
    measured = replace(PRESET, cell_train_tok_s=[4000.0, 500.0, 500.0, 500.0], cell_gen_tok_s=[400.0] * 4)
    fast_core = Simulation(
        PROFILE, measured, SchedulerConfig(mode="async", async_train_cells=1), num_steps=4, tick_s=5.0
    ).run()
    base = Simulation(
        PROFILE, PRESET, SchedulerConfig(mode="async", async_train_cells=1), num_steps=4, tick_s=5.0
    ).run()
    assert fast_core.total_s < base.total_s
    sampled = replace(PROFILE, tool_s_samples=[1.0], gen_tokens_samples=[100.0])
    from gyre.sim.workload import draw_batch

    b = draw_batch(sampled, 0, 0)
    assert set(b.tool_s) == {1.0} and set(b.gen_tokens) == {100.0}
    with pytest.raises(ConfigError) as err:
        replace(PRESET, cell_gen_tok_s=[1.0])
    assert err.value.key == "preset.cell_gen_tok_s" or err.value.key == "cell_gen_tok_s"


def test_measured_switch_phase_times_replace_the_shares():
    sched = SchedulerConfig(mode="colocate")
    base = Simulation(PROFILE, PRESET, sched, num_steps=2, tick_s=5.0).run()
    slow = Simulation(PROFILE, PRESET, sched, num_steps=2, tick_s=5.0, phase_s={"pull_weights": 200.0}).run()
    # every rollout->train switch of colocate's 4 cells pays 200 s for pull_weights instead of 40% of 8.52 s
    assert slow.cells[1].switch_s >= base.cells[1].switch_s + 2 * (200 - 0.4 * 8.52) - 1e-6
    with pytest.raises(ConfigError) as err:
        validate(compose("+phase_s.warp_drive=1"), SimConfig)
    assert err.value.key == "phase_s"


@pytest.mark.parametrize("mode", ["elastic", "async", "colocate"])
def test_a_step_whose_every_group_is_excluded_still_steps(mode):
    """A live core steps over a batch with nothing to train (e.g. every group uniform); so must the sim."""
    profile = replace(PROFILE, groups_per_step=2, group_size=2, excluded_fraction=0.9)
    r = Simulation(profile, PRESET, SchedulerConfig(mode=mode), num_steps=6, tick_s=5.0).run()
    assert len(r.step_times_s) == 6 and r.num_excluded > 6 * 2


def test_the_kv_bound_charges_each_call_its_grown_context():
    """The engine reserves a call's context plus its new prompt and output (gyre.sim.kv) from the
    call's start, so the bound's KV token-seconds count that grown context over the unloaded
    decode time: 3 segments of 1000 tokens hold 1000, 2000 and 3000 tokens (the context before
    each call, 0 + 1000 + 2000, would make the bound 2x looser)."""
    profile = ProfileConfig(
        groups_per_step=1,
        group_size=2,
        segments_samples=[3],
        segments_sigma=0,
        exec_sigma=0,
        gen_tokens_samples=[100.0],
        tool_s_samples=[1.0],
        context_tokens_per_segment=1000,
        excluded_fraction=0,
    )
    preset = replace(PRESET, gen_tok_s_per_node=1e6, prefill_tok_s_per_node=1e9, kv_tokens_per_node=10_000)
    r = Simulation(profile, preset, SchedulerConfig(mode="async"), num_steps=1, tick_s=1.0).run()
    kv_token_s = 2 * (1000 + 2000 + 3000) * 100 / preset.session_tok_s
    assert r.rollout_work_s == pytest.approx(kv_token_s / (preset.kv_tokens_per_node * preset.num_nodes))
    assert r.total_s >= r.work_node_s / r.num_nodes


def test_the_coordinator_starts_executions_one_at_a_time_and_feeds_training_after_its_burst():
    """The live coordinator starts a turn's executions one after another and hands training the
    new step only after them (gyre.coordinator.loop._tick): with start_s, every start is start_s
    after the one before, and after each optimizer step the next step trains no earlier than the
    burst of the batch it admitted (16 executions here, all fitting the free slots)."""
    start_s = 50.0  # long beside the executions, so the starts decide the time
    profile = replace(PROFILE, start_s=start_s)
    sched = SchedulerConfig(mode="async", async_train_cells=1)
    base = Simulation(PROFILE, PRESET, sched, num_steps=4, tick_s=5.0).run()
    r = Simulation(profile, PRESET, sched, num_steps=4, tick_s=5.0).run()
    n = PROFILE.executions_per_step
    assert r.total_s >= (4 * n - 1) * start_s and r.total_s > base.total_s
    gaps = [b - a for a, b in zip(r.step_times_s, r.step_times_s[1:])]
    assert min(gaps[:2]) >= n * start_s  # steps 0 and 1 admit steps 2 and 3 (staleness 1); step 2 none
    with pytest.raises(ConfigError) as err:
        replace(PROFILE, start_s=-1.0)
    assert err.value.key.endswith("start_s")
    # coordinator.start_budget_s: the loop breaks a burst to collect and feed training, which then
    # waits one budget, not the burst; the starts themselves stay one after another
    bounded = Simulation(replace(profile, start_budget_s=start_s), PRESET, sched, num_steps=4, tick_s=5.0).run()
    assert bounded.total_s >= (4 * n - 1) * start_s and bounded.total_s < r.total_s
