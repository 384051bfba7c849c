"""fraction="auto": the cost-model rule, its use by the optimizer and the engine, and agreement
across ranks whose measured speeds differ."""

import copy
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

from dion3_megatron import Dion3, options
from dion3_megatron.core import cost_model, rule
from dion3_megatron.engine import Dion3Engine, MatrixShard, Sharding, fractions
from support.dist_utils import run_distributed

FAST = cost_model.DeviceSpeed(matmul_flops=5e14, launch_seconds=1e-5, memory_bytes_per_s=4e12, link_bytes_per_s=1e11)
LAUNCH_BOUND = cost_model.DeviceSpeed(1e30, 1.0, 1e30, 1e30)  # only the fixed cost per call counts
FLOP_BOUND = cost_model.DeviceSpeed(1e6, 0.0, 1e30, 1e30)  # only the matmul FLOPs count
H200_LIKE = cost_model.DeviceSpeed(matmul_flops=4e14, launch_seconds=6e-6, memory_bytes_per_s=3e12, link_bytes_per_s=1e11)


@pytest.fixture
def step_time_only(monkeypatch):
    """No forward and backward beside the optimizer's step: its time is the whole iteration."""
    monkeypatch.setattr(cost_model, "TOKENS_PER_STEP", 0)


@pytest.mark.parametrize("speed", [FAST, LAUNCH_BOUND, FLOP_BOUND])
def test_choice_is_a_candidate_above_the_row_floor(speed, generator):
    for _ in range(40):
        rows, cols = (int(v) for v in torch.randint(1, 6000, (2,), generator=generator))
        f = cost_model.choose_fraction(rows, cols, speed, batch=int(torch.randint(1, 50, (), generator=generator)))
        assert f in cost_model.CANDIDATE_FRACTIONS
        assert rule.selected_row_count(rows, f) >= min(cost_model.MIN_SELECTED_ROWS, rows)


def test_f_is_1_where_the_model_dominates_the_iteration_and_smaller_where_the_step_does():
    # The convergence protocol's shapes (10.8M and 48.7M) on an H200-like speed: f = 1, below Muon's loss.
    for rows, cols in [(384, 384), (1024, 384), (384, 1024), (640, 640), (1664, 640), (640, 1664)]:
        assert cost_model.choose_fraction(rows, cols, H200_LIKE, batch=10) == 1.0, (rows, cols)
    # 14B shapes: the square and wide products pay for f < 1, none for the loss of 1/8; the tall one
    # (whose Gram NS at f = 1 runs on its 5120 columns) and the K/V keep every row.
    assert cost_model.choose_fraction(5120, 13824, H200_LIKE, batch=16) == 0.5
    assert cost_model.choose_fraction(5120, 5120, H200_LIKE, batch=16) == 0.5
    assert cost_model.choose_fraction(13824, 5120, H200_LIKE, batch=16) == 1.0
    assert cost_model.choose_fraction(1024, 5120, H200_LIKE, batch=16) == 1.0


def test_the_fewest_rows_the_floor_allows_when_slow_matmuls_are_the_whole_iteration(step_time_only):
    assert cost_model.choose_fraction(cost_model.MIN_SELECTED_ROWS, 512, FLOP_BOUND) == 1.0
    assert cost_model.choose_fraction(4096, 4096, FLOP_BOUND) == 0.125
    # floor: 1024 rows at 1/8 would select 128 rows, the minimum; 512 rows need 1/4
    assert cost_model.choose_fraction(512, 4096, FLOP_BOUND) == 0.25


def test_more_tokens_per_step_never_lower_f(monkeypatch, generator):
    for _ in range(40):
        rows, cols = (int(v) for v in torch.randint(64, 16384, (2,), generator=generator))
        batch = int(torch.randint(1, 50, (), generator=generator))
        chosen = []
        for tokens in (0, 1024, 32768, 1 << 20):
            monkeypatch.setattr(cost_model, "TOKENS_PER_STEP", tokens)
            chosen.append(cost_model.choose_fraction(rows, cols, H200_LIKE, batch=batch))
        assert chosen == sorted(chosen), (rows, cols, batch, chosen)
        assert chosen[-1] == 1.0  # a model that long makes the step's savings worth no loss


def test_a_rank_that_steps_a_share_of_the_matrices_keeps_more_rows():
    # Megatron's layer-wise ZeRO-1 at DP=8: each rank steps 1/8 of the matrices it runs forward
    # and backward, so the step is a smaller share of its iteration.
    assert cost_model.choose_fraction(5120, 13824, H200_LIKE, batch=16) == 0.5
    assert cost_model.choose_fraction(5120, 13824, H200_LIKE, batch=16, step_share=1 / 8) == 1.0
    for n, m in [(5120, 5120), (2048, 8192), (8192, 2048)]:
        shares = [cost_model.choose_fraction(n, m, H200_LIKE, batch=8, step_share=s) for s in (1.0, 0.5, 0.125)]
        assert shares == sorted(shares), (n, m, shares)


def test_the_choice_has_the_lowest_modelled_loss(generator):
    for _ in range(40):
        rows, cols = (int(v) for v in torch.randint(128, 16384, (2,), generator=generator))
        f = cost_model.choose_fraction(rows, cols, H200_LIKE, batch=8)
        change = {
            g: cost_model.modelled_loss_change(rows, cols, g, H200_LIKE, batch=8)
            for g in cost_model.CANDIDATE_FRACTIONS
            if rule.selected_row_count(rows, g) >= 128
        }
        assert change[1.0] == 0.0 and change[f] == min(change.values())


def test_free_rows_are_taken_when_the_step_is_launch_bound(step_time_only):
    assert cost_model.choose_fraction(4096, 4096, LAUNCH_BOUND) == 1.0
    assert cost_model.choose_fraction(4096, 4096, FAST) < 1.0


def test_a_slow_link_lowers_the_fraction_at_larger_world_sizes(step_time_only):
    slow_link = cost_model.DeviceSpeed(1e30, 1e-4, 1e30, 1e6)
    assert cost_model.choose_fraction(4096, 4096, slow_link, world=1, batch=8) == 1.0
    assert cost_model.choose_fraction(4096, 4096, slow_link, world=8, batch=8) == 0.125


def test_modelled_cost_grows_with_the_fraction(generator):
    """More rows, more time; except where a fraction's selected block is square, which takes standard
    Newton-Schulz and its shorter run of launches (where launches dominate, the model puts a 64 x 64
    matrix at f = 1 below its 8 x 64 block at f = 1/8)."""
    checked = 0
    while checked < 20:
        rows, cols = (int(v) for v in torch.randint(64, 8000, (2,), generator=generator))
        levels = sorted(cost_model.CANDIDATE_FRACTIONS)
        if any(rule.selected_row_count(rows, f) == cols for f in levels):
            continue
        costs = [cost_model.estimated_step_seconds(rows, cols, f, FAST, world=4, batch=6) for f in levels]
        assert costs == sorted(costs), (rows, cols, costs)
        checked += 1
    square = [cost_model.estimated_step_seconds(64, 64, f, FAST, world=4, batch=6) for f in (0.125, 1.0)]
    assert square[1] < square[0]


def test_measured_speed_is_positive_and_cached():
    speed = fractions.measure(torch.device("cpu"), torch.float32)
    assert all(v > 0 for v in (speed.matmul_flops, speed.launch_seconds, speed.memory_bytes_per_s))
    assert fractions.measure(torch.device("cpu"), torch.float32) is speed


def test_bad_fraction_strings_are_refused():
    with pytest.raises(ValueError, match="fraction must be in \\(0, 1\\] or 'auto'"):
        Dion3([torch.nn.Parameter(torch.randn(4, 4))], fraction="half")


@pytest.mark.slow
def test_optimizer_auto_equals_the_resolved_fixed_fractions(monkeypatch, generator, step_time_only):
    monkeypatch.setattr(fractions, "measure", lambda device, dtype: FLOP_BOUND)
    shapes = [(64, 48), (512, 96), (512, 96), (1024, 64), (3, 256, 40)]
    weights = [torch.randn(s, generator=generator) for s in shapes]
    grads = [[torch.randn(s, generator=generator) for s in shapes] for _ in range(3)]
    auto_params = [torch.nn.Parameter(w.clone()) for w in weights]
    auto = Dion3(auto_params, lr=0.02, fraction="auto", ns_dtype=torch.float32)
    for step_grads in grads:
        for p, g in zip(auto_params, step_grads):
            p.grad = g.clone()
        auto.step()
    chosen = [auto.fractions[p] for p in auto_params]
    # FLOP-bound: the smallest f that still selects 128 rows (all rows of smaller matrices)
    assert chosen == [1.0, 0.25, 0.25, 0.125, 0.5]
    fixed_params = [torch.nn.Parameter(w.clone()) for w in weights]
    fixed = Dion3([{"params": [p], "fraction": f} for p, f in zip(fixed_params, chosen)], lr=0.02, ns_dtype=torch.float32)
    for step_grads in grads:
        for p, g in zip(fixed_params, step_grads):
            p.grad = g.clone()
        fixed.step()
    for a, b in zip(auto_params, fixed_params):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_fractions_print_parameter_names_and_a_parameter_still_finds_its_f(monkeypatch, step_time_only):
    monkeypatch.setattr(fractions, "measure", lambda device, dtype: FLOP_BOUND)
    model = torch.nn.Sequential(torch.nn.Linear(96, 512), torch.nn.Linear(64, 1024, bias=False))
    for params, names in (
        (model.named_parameters(), ["0.weight", "1.weight"]),
        (model.parameters(), ["group0.param0", "group0.param1"]),
    ):  # bias: group 1, AdamW
        opt = Dion3(params, fraction="auto", ns_dtype=torch.float32)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        assert repr(opt.fractions) == repr(dict(zip(names, [0.25, 0.125])))  # no tensor data
        assert opt.fractions[model[0].weight] == 0.25 and model[1].weight in opt.fractions
        assert model[0].bias not in opt.fractions and opt.fractions.get(model[0].bias, "AdamW") == "AdamW"
        resumed = Dion3(model.parameters(), fraction="auto", ns_dtype=torch.float32)
        resumed.load_state_dict(opt.state_dict())
        assert list(resumed.fractions.values()) == [0.25, 0.125]


def test_the_record_is_per_group_by_matrix_name_and_a_bad_one_is_refused(monkeypatch, step_time_only):
    monkeypatch.setattr(fractions, "measure", lambda device, dtype: LAUNCH_BOUND)  # would choose f = 1
    model = torch.nn.ModuleDict({"dense": torch.nn.Linear(96, 512, bias=False)})
    experts = torch.nn.Parameter(torch.randn(2, 1024, 64))
    params = [("dense.weight", model["dense"].weight), ("experts", experts)]
    opt = Dion3(params, fraction="auto", ns_dtype=torch.float32)
    for _, p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    saved = opt.state_dict()
    assert [g["fractions"] for g in saved["param_groups"]] == [{"dense.weight": 1.0, "experts.matrix0": 1.0, "experts.matrix1": 1.0}]
    assert set(saved) == {"state", "param_groups", "skipped_steps"}  # the record lives in the groups alone
    saved["param_groups"][0]["fractions"] = {"dense.weight": 0.25, "experts.matrix0": 0.125, "experts.matrix1": 0.125}
    resumed = Dion3(params, fraction="auto", ns_dtype=torch.float32)
    resumed.load_state_dict(saved)
    resumed.step()
    assert dict(resumed.fractions) == {"dense.weight": 0.25, "experts": 0.125}
    for record, message in (
        ({"dense.weight": 0.3}, "param group 0: 'dense.weight' has fraction 0.3"),
        ({5: 0.25}, "param group 0: 5 has fraction 0.25"),
        ([0.25], "param group 0: 'fractions' must map matrix names to f"),
    ):
        bad = {**saved, "param_groups": [{**saved["param_groups"][0], "fractions": record}]}
        fresh = Dion3(params, fraction="auto", ns_dtype=torch.float32)
        before = fresh.state_dict()
        with pytest.raises(ValueError, match=message):
            fresh.load_state_dict(bad)
        assert fresh.state_dict() == before  # refused whole: nothing loaded


@pytest.mark.slow
def test_a_resume_keeps_the_saved_choices_on_a_machine_of_another_speed(monkeypatch, generator, step_time_only):
    # Resumed where the device measures differently, fraction="auto" must not choose again.
    shapes = [(512, 96), (1024, 64), (64, 48)]
    weights = [torch.randn(s, generator=generator) for s in shapes]
    grads = [[torch.randn(s, generator=generator) for s in shapes] for _ in range(4)]

    def run(params, opt, steps):
        for step_grads in steps:
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            opt.step()

    monkeypatch.setattr(fractions, "measure", lambda device, dtype: FLOP_BOUND)
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = Dion3(params, lr=0.02, fraction="auto", ns_dtype=torch.float32)
    run(params, opt, grads[:2])
    saved = copy.deepcopy(opt.state_dict())
    saved_weights = [p.detach().clone() for p in params]
    run(params, opt, grads[2:])
    monkeypatch.setattr(fractions, "measure", lambda device, dtype: LAUNCH_BOUND)  # would choose f = 1
    resumed = [torch.nn.Parameter(w) for w in saved_weights]
    other = Dion3(resumed, lr=0.02, fraction="auto", ns_dtype=torch.float32)
    other.load_state_dict(saved)
    run(resumed, other, grads[2:])
    assert [other.fractions[p] for p in resumed] == [opt.fractions[p] for p in params] == [0.25, 0.125, 1.0]
    for a, b in zip(params, resumed):
        assert torch.equal(a, b)


ENGINE_SHAPES = [(512, 64), (512, 64), (1024, 32)]  # the engine's matrices, drawn from seed 7


def _engine_worker(rank, world, shapes, seed):
    # Each rank measures a different speed: alone, rank 0 would take 1/4 of (512, 64)'s rows and
    # rank 1 all of them.
    fractions.measure = lambda device, dtype: [FLOP_BOUND, LAUNCH_BOUND][rank]
    cost_model.TOKENS_PER_STEP = 0  # the step is the whole iteration (put back after the case)
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(3)]
    group = dist.new_group(list(range(world)))
    hp = options.hyperparameters(lr=0.02, fraction="auto", ns_dtype=torch.float32)
    shards = []
    for j, (w, (n, m)) in enumerate(zip(weights, shapes)):
        sharding = Sharding.even_rows(n, world)
        b = sharding.bounds
        shards.append(MatrixShard(f"m{j}", w[b[rank] : b[rank + 1]].clone(), None, (n, m), sharding, group, hp))
    engine = Dion3Engine(shards)
    for step_grads in grads:
        for shard, g in zip(shards, step_grads):
            b = shard.sharding.bounds
            shard.grad = g[b[rank] : b[rank + 1]].clone()
        engine.step()
    chosen = {sg.key[0]: sg.fraction for sg in engine.plan}
    return chosen, [s.weight for s in shards], weights, grads


@pytest.mark.slow
def test_engine_ranks_agree_on_the_slowest_speed_and_match_the_single_process_rule(two_rank_runs, step_time_only):
    shapes = ENGINE_SHAPES
    assert cost_model.choose_fraction(512, 64, FLOP_BOUND, world=2, batch=2) == 0.25
    assert cost_model.choose_fraction(512, 64, LAUNCH_BOUND, world=2, batch=2) == 1.0
    results = two_rank_runs["engine"]
    (fractions0, pieces0, weights, grads), (fractions1, pieces1, _, _) = results
    assert fractions0 == fractions1
    slowest = cost_model.DeviceSpeed(FLOP_BOUND.matmul_flops, LAUNCH_BOUND.launch_seconds, 1e30, fractions.LINK_BYTES_PER_S["gloo"])
    for (n, m), f in fractions0.items():
        assert f == cost_model.choose_fraction(n, m, slowest, world=2, batch=shapes.count((n, m)))
    assert fractions0[(512, 64)] == 0.5  # neither rank's own choice
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    reference = Dion3([{"params": [p], "fraction": fractions0[tuple(p.shape)]} for p in params], lr=0.02, ns_dtype=torch.float32)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        reference.step()
    for j, p in enumerate(params):
        torch.testing.assert_close(torch.cat([pieces0[j], pieces1[j]]), p.detach(), rtol=1e-5, atol=1e-5)


def _share_worker(rank, world):
    # The ranks of one exchange step shares of their models that differ: alone, rank 0 (share 1)
    # would take 1/4 of (512, 64)'s rows and rank 1 (share 0.1) 1/2; they must agree.
    fractions.measure = lambda device, dtype: FLOP_BOUND
    cost_model.TOKENS_PER_STEP = 10  # put back after the case
    alone = [cost_model.choose_fraction(512, 64, FLOP_BOUND, world=2, batch=1, step_share=s) for s in (1.0, 0.1)]
    group = dist.new_group(list(range(world)))
    hp = options.hyperparameters(lr=0.02, fraction="auto", ns_dtype=torch.float32)
    sharding = Sharding.even_rows(512, world)
    b = sharding.bounds
    weight = torch.randn(512, 64, generator=torch.Generator().manual_seed(0))[b[rank] : b[rank + 1]].clone()
    engine = Dion3Engine([MatrixShard("m", weight, None, (512, 64), sharding, group, hp)], step_share=[1.0, 0.1][rank])
    return alone, engine.auto_fractions()


@pytest.mark.slow
def test_ranks_of_one_exchange_agree_on_the_largest_step_share(two_rank_runs):
    (alone, chosen0), (_, chosen1) = two_rank_runs["share"]
    assert alone == [0.25, 0.5]
    assert chosen0 == chosen1 == {(512, 64): 0.25}


def _stage_worker(rank, world):
    # Pipeline-like ranks under the default fraction ("auto"): rank 1 holds only an AdamW tensor at
    # first and skips its first step (a non-finite gradient), rank 0 steps a matrix; at the third
    # step rank 1 alone has a matrix added. Alone, rank 0 would keep every row of (512, 96) and
    # rank 1 would take 1/8 of (1024, 64); agreed on the slowest numbers of both, each takes 1/2.
    fractions.measure = lambda device, dtype: [LAUNCH_BOUND, FLOP_BOUND][rank]
    cost_model.TOKENS_PER_STEP = 0  # put back after the case
    gen = torch.Generator().manual_seed(rank)
    bias = torch.nn.Parameter(torch.randn(96, generator=gen))
    params = [torch.nn.Parameter(torch.randn(512, 96, generator=gen)), bias] if rank == 0 else [bias]
    opt = Dion3(params, ns_dtype=torch.float32)

    def step(first=False):
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad = torch.randn(p.shape, generator=gen)
        if first and rank == 1:
            bias.grad[0] = float("inf")
        opt.step()
        dist.all_reduce(torch.ones(1))  # the training loop's own collective (a loss average, a send)

    step(first=True)
    step()
    late = torch.nn.Parameter(torch.randn(1024, 64, generator=gen))
    if rank == 1:
        opt.add_param_group({"params": [late]})
    step()
    alone = [cost_model.choose_fraction(512, 96, LAUNCH_BOUND), cost_model.choose_fraction(1024, 64, FLOP_BOUND)]
    return opt.skipped_steps, sorted(opt.fractions.values()), alone


@pytest.mark.slow
def test_ranks_without_matrices_or_with_a_skipped_first_step_still_agree_and_never_hang(two_rank_runs):
    """The torch class's ranks agree on the speed once, at their first step, whatever each holds;
    a rank that waited in a collective its peer never made would time out here."""
    (skipped0, chosen0, alone), (skipped1, chosen1, _) = two_rank_runs["stage"]
    assert alone == [1.0, 0.125]
    assert (skipped0, skipped1) == (0, 1)
    assert chosen0 == chosen1 == [0.5]


def _dtypes_worker(rank, world):
    # Rank 0 steps "auto" groups of two Newton-Schulz dtypes, rank 1 one of them beside a group of
    # fixed f: one collective each all the same, every dtype at the slower rank of those stepping it.
    fractions.measure = lambda device, dtype: [LAUNCH_BOUND, FLOP_BOUND][rank]
    cost_model.TOKENS_PER_STEP = 0  # put back after the case
    gen = torch.Generator().manual_seed(rank)
    shared = torch.nn.Parameter(torch.randn(1024, 64, generator=gen))
    own = torch.nn.Parameter(torch.randn(512, 96, generator=gen))
    first = {"params": [own]} if rank == 0 else {"params": [own], "fraction": 0.25}
    opt = Dion3([first, {"params": [shared], "ns_dtype": torch.float64}], ns_dtype=torch.float32)
    for _ in range(2):
        for p in (shared, own):
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        dist.all_reduce(torch.ones(1))  # the training loop's own collective
    opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(64, 32, generator=gen))], "ns_dtype": torch.bfloat16})
    with pytest.raises(ValueError, match="ns_dtype=torch.bfloat16: no rank stepped a group of that dtype") as error:
        opt.step()
    expected = {
        "shared": cost_model.choose_fraction(1024, 64, fractions.slowest(LAUNCH_BOUND, FLOP_BOUND)),
        "own": cost_model.choose_fraction(512, 96, LAUNCH_BOUND) if rank == 0 else None,
    }
    return {name: opt.fractions.get(p) for name, p in (("shared", shared), ("own", own))}, expected, str(error.value)


@pytest.mark.slow
def test_ranks_with_groups_of_other_dtypes_agree_in_one_collective(two_rank_runs):
    """A rank with more Newton-Schulz dtypes in its "auto" groups than its peer makes no extra
    collective (its peer would wait in another, or pair it with the training loop's); a dtype that
    no rank stepped at the first step is refused later, naming it."""
    (chosen0, expected0, error0), (chosen1, expected1, _) = two_rank_runs["dtypes"]
    assert chosen0 == expected0 and chosen1 == expected1
    assert chosen0["shared"] == chosen1["shared"] and expected0["shared"] != expected0["own"]
    assert "give such groups from the start" in error0


def _megatron_replicas_worker(rank, world):
    # Data-parallel replicas without the distributed optimizer: each steps the same whole matrix.
    # Alone, rank 0 would keep every row of (512, 96) and rank 1 take fewer; they must agree.
    from dion3_megatron.megatron import MegatronDion3

    fractions.measure = lambda device, dtype: [LAUNCH_BOUND, FLOP_BOUND][rank]
    cost_model.TOKENS_PER_STEP = 0  # put back after the case
    weight = torch.nn.Parameter(torch.randn(512, 96, generator=torch.Generator().manual_seed(0)))
    opt = MegatronDion3([{"params": [weight]}], lr=0.02, fraction="auto")
    weight.grad = torch.randn(512, 96, generator=torch.Generator().manual_seed(1))
    opt.step()
    alone = [cost_model.choose_fraction(512, 96, speed) for speed in (LAUNCH_BOUND, FLOP_BOUND)]
    return opt.fractions_of(weight), alone


@pytest.mark.slow
def test_megatron_replicas_of_a_whole_matrix_choose_one_fraction(two_rank_runs, step_time_only):
    (chosen0, alone), (chosen1, _) = two_rank_runs["megatron"]
    assert alone[0] != alone[1]
    expected = cost_model.choose_fraction(512, 96, fractions.slowest(LAUNCH_BOUND, FLOP_BOUND))
    assert chosen0 == chosen1 == [((512, 96), expected)]


def _scoped(worker: Callable[..., Any], rank: int, world: int, *args: Any) -> Any:
    """``worker``'s result, with what it replaces process-wide (``fractions.measure``,
    ``cost_model.TOKENS_PER_STEP``) and the measured speeds put back after it: the cases share two
    processes, and each must start from what a fresh process has."""
    measure, tokens, measured = fractions.measure, cost_model.TOKENS_PER_STEP, dict(fractions._measured)
    fractions._measured.clear()
    try:
        return worker(rank, world, *args)
    finally:
        fractions.measure, cost_model.TOKENS_PER_STEP = measure, tokens
        fractions._measured.clear()
        fractions._measured.update(measured)


def _two_rank_worker(rank: int, world: int) -> dict[str, Any]:
    """The two-rank cases above on one process group (starting one costs more than they do)."""
    return {
        "engine": _scoped(_engine_worker, rank, world, ENGINE_SHAPES, 7),
        "share": _scoped(_share_worker, rank, world),
        "stage": _scoped(_stage_worker, rank, world),
        "dtypes": _scoped(_dtypes_worker, rank, world),
        "megatron": _scoped(_megatron_replicas_worker, rank, world),
    }


@pytest.fixture(scope="module")
def two_rank_runs() -> dict[str, list[Any]]:
    """The two-rank worker's results, by case and then by rank."""
    per_rank = run_distributed(_two_rank_worker, 2, timeout=300)
    return {case: [out[case] for out in per_rank] for case in per_rank[0]}
