"""The megabatch engine: sharded Dion3 over gloo equals the single-process optimizer on full
matrices, with a constant number of collectives per shape and no full-matrix buffers."""

import math
import time

import pytest
import torch
import torch.distributed as dist

from dion3_megatron import Dion3, options
from dion3_megatron.core import rule
from dion3_megatron.engine import Dion3Engine, MatrixShard, Sharding
from support.dist_utils import run_distributed

STEPS = 3


def make_sharding(kind: str, n: int, m: int, world: int, j: int) -> Sharding:
    if kind == "rows":
        return Sharding.even_rows(n, world)
    if kind == "cols":
        return Sharding.even_cols(m, world)
    if kind == "flat":  # uneven ZeRO-like slices: partial rows, and an empty range on 4 ranks
        total = n * m
        cuts = [0] + sorted({(total * (i + 1)) // (world + 1) + 3 * j for i in range(world - 1)}) + [total]
        if world == 4:
            cuts[2] = cuts[1]
        return Sharding.flat(cuts)
    if kind == "block_flat":  # ZeRO slices (2, uneven) of tensor-parallel blocks (2), rank r = block r % 2
        split = ["rows", "cols"][j % 2]
        block = (n // 2) * m
        return Sharding.block_flat(split, [0, block // 3 + j, block], [(r % 2, r // 2) for r in range(world)])
    if kind == "rowscols":  # one shape split both ways (QKV and the attention projection)
        return make_sharding(["rows", "cols"][j % 2], n, m, world, j)
    if kind == "mixed":
        return make_sharding(["rows", "cols", "flat"][j % 3], n, m, world, j)
    raise ValueError(kind)


def tensor_parallel_block(full: torch.Tensor, sharding: Sharding, t: int) -> torch.Tensor:
    return full.chunk(sharding.blocks, 0 if sharding.split == "rows" else 1)[t].contiguous()


def local_piece(full: torch.Tensor, sharding: Sharding, rank: int) -> torch.Tensor:
    b = sharding.bounds
    if sharding.kind == "block_flat":
        t, d = sharding.places[rank]
        return tensor_parallel_block(full, sharding, t).reshape(-1)[b[d] : b[d + 1]].clone()
    if sharding.kind == "rows":
        return full[b[rank] : b[rank + 1]].clone()
    if sharding.kind == "cols":
        return full[:, b[rank] : b[rank + 1]].contiguous()
    return full.reshape(-1)[b[rank] : b[rank + 1]].clone()


def matrices_and_grads(shapes, seed, steps=STEPS):
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(steps)]
    return weights, grads


DEFAULT_STALENESS = options.BY_NAME["staleness"].default
HP = dict(lr=0.02, mu=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8, ns_dtype=torch.float32)


def sharded_worker(
    rank,
    world,
    kind,
    shapes,
    fraction,
    seed,
    staleness=DEFAULT_STALENESS,
    steps=STEPS,
    mu=HP["mu"],
    ns_dtype=HP["ns_dtype"],
    momentum_dtype="fp32",
):
    weights, grads = matrices_and_grads(shapes, seed, steps)
    hp = options.hyperparameters(
        fraction=fraction, staleness=staleness, momentum_dtype=momentum_dtype, **dict(HP, mu=mu, ns_dtype=ns_dtype)
    )
    group = dist.new_group(list(range(world)))
    shards = []
    for j, (w, shape) in enumerate(zip(weights, shapes)):
        sharding = make_sharding(kind, *shape, world, j)
        shards.append(MatrixShard(f"m{j}", local_piece(w, sharding, rank), None, shape, sharding, group, hp))
    engine = Dion3Engine(shards)
    for step in range(steps):
        for shard, g in zip(shards, grads[step]):
            shard.grad = local_piece(g, shard.sharding, rank)
        engine.step()
    return [s.weight for s in shards]


def reassemble(pieces_per_rank, kind, shapes, world):
    out = []
    for j, shape in enumerate(shapes):
        sharding = make_sharding(kind, *shape, world, j)
        pieces = [pieces_per_rank[r][j] for r in range(world)]
        if sharding.kind == "block_flat":
            blocks = []
            for t in range(sharding.blocks):
                mine = sorted((d, r) for r, (tt, d) in enumerate(sharding.places) if tt == t)
                block_shape = tensor_parallel_block(torch.empty(shape), sharding, t).shape
                blocks.append(torch.cat([pieces[r].reshape(-1) for _, r in mine]).view(block_shape))
            out.append(torch.cat(blocks, 0 if sharding.split == "rows" else 1))
        elif sharding.kind == "rows":
            out.append(torch.cat(pieces, 0))
        elif sharding.kind == "cols":
            out.append(torch.cat(pieces, 1))
        else:
            out.append(torch.cat([p.reshape(-1) for p in pieces]).view(shape))
    return out


def single_process(
    shapes, fraction, seed, staleness=DEFAULT_STALENESS, steps=STEPS, mu=HP["mu"], ns_dtype=HP["ns_dtype"], momentum_dtype="fp32"
):
    weights, grads = matrices_and_grads(shapes, seed, steps)
    params = [torch.nn.Parameter(w) for w in weights]
    named = [(f"m{j}", p) for j, p in enumerate(params)]  # the sharded run's names: a bf16 momentum's noise is hashed from them
    opt = Dion3(named, fraction=fraction, staleness=staleness, momentum_dtype=momentum_dtype, **dict(HP, mu=mu, ns_dtype=ns_dtype))
    for step in range(steps):
        for p, g in zip(params, grads[step]):
            p.grad = g
        opt.step()
    return [p.detach() for p in params]


def max_relative_error(got, expected):
    return max(((g - e).norm() / e.norm()).item() for g, e in zip(got, expected))


# 5 matrices of one shape (not divisible by 2 or 4) plus a second shape: transposed aspect.
SHAPES = [(24, 40)] * 5 + [(40, 24)] * 2


FP32, BF16 = HP["ns_dtype"], torch.bfloat16
STALE_STEPS = 8  # several expected periods (1 / f = 4 steps): rows come back because they waited

# (world, kind, fraction) of each test below. Column blocks take the static exchange; row blocks
# on 2 ranks while f * world <= 1, else the host-planned one (rows 1.0, world 4); flat, block_flat
# and mixed the general one.
EQUAL = [
    (2, "rows", 0.25),
    (2, "rowscols", 0.25),
    (2, "cols", 1.0),
    (2, "cols", 0.25),
    (2, "flat", 0.25),
    (4, "mixed", 0.25),
    (4, "flat", 1.0),
    (4, "rows", 0.25),
    (4, "cols", 0.25),
    (2, "rows", 1.0),
    (4, "rowscols", 0.5),
    (4, "block_flat", 0.25),
]
STALE = [
    (2, "rows", 0.25),
    (4, "rows", 0.25),
    (2, "cols", 0.25),
    (2, "rowscols", 0.25),
    (4, "rowscols", 0.5),
    (2, "flat", 0.25),
    (4, "block_flat", 0.25),
    (4, "mixed", 0.25),
]
DEFAULT_MU = [(4, "rows", 0.125), (2, "flat", 0.125)]  # the static exchange and the general one
HALF = [(2, "rows", 0.25), (2, "cols", 1.0), (4, "block_flat", 0.25)]
# bf16 momentum on each exchange: static (row and column blocks, f = 1's folded decay), planned, general
BF16_MOMENTUM = [(2, "rows", 0.25), (2, "cols", 1.0), (4, "rows", 0.25), (2, "flat", 0.25), (4, "mixed", 0.25)]

# A case: (world, kind, fraction, staleness, steps, mu, ns_dtype), the arguments of sharded_worker
# after the seed.
CASES = (
    [(*case, DEFAULT_STALENESS, STEPS, HP["mu"], FP32) for case in EQUAL]
    + [(*case, 1.0, STALE_STEPS, HP["mu"], FP32) for case in STALE]
    + [(*case, DEFAULT_STALENESS, STALE_STEPS, None, FP32) for case in DEFAULT_MU]
    + [(*case, DEFAULT_STALENESS, STEPS, HP["mu"], BF16) for case in HALF]
    + [(*case, 1.0, STALE_STEPS, HP["mu"], FP32, "bf16") for case in BF16_MOMENTUM]
)


def cases_worker(rank, world, cases):
    return [sharded_worker(rank, world, kind, SHAPES, fraction, seed, *rest) for kind, fraction, seed, *rest in cases]


@pytest.fixture(scope="module")
def sharded():
    """case -> (the weights the sharded engine reassembled, the case's seed): every case of one
    world size in one group of processes (starting one, mostly imports, costs more than a case),
    each case with inputs drawn fresh."""
    seeds = {case: torch.seed() % 2**31 for case in CASES}
    out = {}
    for world in (2, 4):
        mine = [case for case in CASES if case[0] == world]
        per_rank = run_distributed(
            cases_worker, world, [(kind, fraction, seeds[case], *rest) for case in mine for _, kind, fraction, *rest in (case,)]
        )
        for i, case in enumerate(mine):
            out[case] = (reassemble([pieces[i] for pieces in per_rank], case[1], SHAPES, world), seeds[case])
    return out


@pytest.mark.parametrize("world,kind,fraction", EQUAL)
@pytest.mark.slow
def test_sharded_step_equals_single_process(sharded, world, kind, fraction):
    got, seed = sharded[(world, kind, fraction, DEFAULT_STALENESS, STEPS, HP["mu"], FP32)]
    expected = single_process(SHAPES, fraction, seed)
    assert max_relative_error(got, expected) <= 1e-5, f"seed={seed}"


@pytest.mark.parametrize("world,kind,fraction", STALE)
@pytest.mark.slow
def test_sharded_step_with_staleness_equals_single_process(sharded, world, kind, fraction):
    got, seed = sharded[(world, kind, fraction, 1.0, STALE_STEPS, HP["mu"], FP32)]
    expected = single_process(SHAPES, fraction, seed, 1.0, STALE_STEPS)
    assert max_relative_error(got, expected) <= 1e-5, f"seed={seed}"
    # staleness changed the result: the test would catch an engine that ignored it
    assert max_relative_error(single_process(SHAPES, fraction, seed, 0.0, STALE_STEPS), expected) > 1e-3


@pytest.mark.parametrize("world,kind,fraction", DEFAULT_MU)
@pytest.mark.slow
def test_sharded_step_with_the_default_mu_at_one_eighth_equals_single_process(sharded, world, kind, fraction):
    # mu unset: each path must decay the applied rows by the f-dependent default (0.36 at f = 1/8)
    got, seed = sharded[(world, kind, fraction, DEFAULT_STALENESS, STALE_STEPS, None, FP32)]
    expected = single_process(SHAPES, fraction, seed, DEFAULT_STALENESS, STALE_STEPS, None)
    assert max_relative_error(got, expected) <= 1e-5, f"seed={seed}"
    # the default is not f = 1/4's 0.6 here (a path that ignored f would fail the comparison above):
    # the updates differ, compared as updates since they are small against the weights
    start, _ = matrices_and_grads(SHAPES, seed, STALE_STEPS)
    at_0_6 = single_process(SHAPES, fraction, seed, DEFAULT_STALENESS, STALE_STEPS, 0.6)
    updates = lambda ws: [w - w0 for w, w0 in zip(ws, start)]  # noqa: E731
    assert max_relative_error(updates(at_0_6), updates(expected)) > 0.01


@pytest.mark.parametrize("world,kind,fraction", HALF)
@pytest.mark.slow
def test_sharded_step_with_half_precision_newton_schulz_equals_single_process(sharded, world, kind, fraction):
    """bf16 Newton-Schulz hands its result on in bf16 (no fp32 copy): every exchange must take it
    as the single process does (on GPUs this is the default's path; on the CPU only when asked)."""
    got, seed = sharded[(world, kind, fraction, DEFAULT_STALENESS, STEPS, HP["mu"], BF16)]
    expected = single_process(SHAPES, fraction, seed, ns_dtype=BF16)
    assert max_relative_error(got, expected) <= 1e-5, f"seed={seed}"
    # bf16 Newton-Schulz did run: its steps are not fp32's
    assert max_relative_error(single_process(SHAPES, fraction, seed), expected) > 1e-4


@pytest.mark.parametrize("world,kind,fraction", BF16_MOMENTUM)
@pytest.mark.slow
def test_sharded_step_with_bf16_momentum_equals_single_process(sharded, world, kind, fraction):
    """A bf16 momentum's rounding noise is hashed from each entry's place in the logical matrix:
    every rank rounds its piece as the single process rounds the whole matrix."""
    got, seed = sharded[(world, kind, fraction, 1.0, STALE_STEPS, HP["mu"], FP32, "bf16")]
    expected = single_process(SHAPES, fraction, seed, 1.0, STALE_STEPS, momentum_dtype="bf16")
    assert max_relative_error(got, expected) <= 1e-5, f"seed={seed}"
    # the momentum was bf16: its steps are not fp32's
    assert max_relative_error(single_process(SHAPES, fraction, seed, 1.0, STALE_STEPS), expected) > 3e-5


def test_unsharded_matrices_step_locally_like_the_optimizer():
    seed = torch.seed() % 2**31
    weights, grads = matrices_and_grads(SHAPES, seed)
    hp = options.hyperparameters(fraction=0.25, **HP)
    shards = [MatrixShard(f"m{j}", w.clone(), None, w.shape, Sharding.full(), None, hp) for j, w in enumerate(weights)]
    engine = Dion3Engine(shards)
    for step in range(STEPS):
        for shard, g in zip(shards, grads[step]):
            shard.grad = g
        engine.step()
    assert engine.collectives == []
    assert max_relative_error([s.weight for s in shards], single_process(SHAPES, 0.25, seed)) <= 1e-6


@pytest.mark.parametrize("cuda_graph", [True, False])
def test_an_engine_without_matrices_steps_as_a_no_op(cuda_graph):
    # Megatron builds one on a data-parallel rank that owns no matrix; it must step like the others.
    engine = Dion3Engine([], cuda_graph=cuda_graph)
    engine.step()
    assert engine.collectives == [] and engine.auto_fractions() == {}


def test_unsharded_matrices_never_wait_for_the_host_and_keep_per_matrix_settings(monkeypatch):
    seed = torch.seed() % 2**31
    weights, grads = matrices_and_grads(SHAPES, seed)
    settings = [dict(HP, mu=0.9 - 0.05 * (j % 3), lr=0.02 * (1 + j % 2)) for j in range(len(SHAPES))]
    shards = [
        MatrixShard(f"m{j}", w.clone(), None, w.shape, Sharding.full(), None, options.hyperparameters(fraction=0.25, **settings[j]))
        for j, w in enumerate(weights)
    ]
    engine = Dion3Engine(shards)
    copies_to_host = []
    original_cpu = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda t, *a, **k: copies_to_host.append(t.shape) or original_cpu(t, *a, **k))
    for step in range(STEPS):
        for shard, g in zip(shards, grads[step]):
            shard.grad = g
        engine.step()
    assert copies_to_host == []
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = Dion3([{"params": [p], **settings[j]} for j, p in enumerate(params)], fraction=0.25)
    for step in range(STEPS):
        for p, g in zip(params, grads[step]):
            p.grad = g
        opt.step()
    assert max_relative_error([s.weight for s in shards], [p.detach() for p in params]) <= 1e-6


def static_exchange_worker(rank, world, kind, fraction, seed):
    weights, grads = matrices_and_grads(SHAPES, seed)
    group = dist.new_group(list(range(world)))
    shards = []
    for j, (w, shape) in enumerate(zip(weights, SHAPES)):
        sharding = make_sharding(kind, *shape, world, j)
        hp = options.hyperparameters(fraction=fraction, **dict(HP, mu=0.9 - 0.05 * (j % 3), lr=0.02 * (1 + j % 2)))
        shards.append(MatrixShard(f"m{j}", local_piece(w, sharding, rank), None, shape, sharding, group, hp))
    engine = Dion3Engine(shards)
    to_host = []
    for step in range(STEPS):
        for shard, g in zip(shards, grads[step]):
            shard.grad = local_piece(g, shard.sharding, rank)
        pending = engine.start_step()
        to_host.append(list(pending.host_rows))
        engine.finish_step(pending)
    return [s.weight for s in shards], to_host


# (kind, fraction, whether the exchange is static) of the tensor-parallel blocks' test
STATIC_EXCHANGES = [("rowscols", 0.25, True), ("rows", 1.0, False)]


@pytest.mark.slow
@pytest.mark.parametrize("kind,fraction,static", STATIC_EXCHANGES)
def test_tensor_parallel_blocks_exchange_without_the_host_while_f_times_world_fits(two_rank_runs, kind, fraction, static):
    results, seed = two_rank_runs["static"][kind, fraction]
    for _, to_host in results:
        assert all((groups == []) == static for groups in to_host), to_host
    got = reassemble([weights for weights, _ in results], kind, SHAPES, 2)
    weights, grads = matrices_and_grads(SHAPES, seed)
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = Dion3(
        [{"params": [p], "mu": 0.9 - 0.05 * (j % 3), "lr": 0.02 * (1 + j % 2)} for j, p in enumerate(params)],
        fraction=fraction,
        **{k: v for k, v in HP.items() if k not in ("mu", "lr")},
    )
    for step in range(STEPS):
        for p, g in zip(params, grads[step]):
            p.grad = g
        opt.step()
    assert max_relative_error(got, [p.detach() for p in params]) <= 1e-5, f"seed={seed}"


def counting_worker(rank, world, layers, fraction):
    counts = {"all_reduce": 0, "all_to_all_single": 0, "other": 0}
    originals = {}
    for name in (
        "all_reduce",
        "all_to_all_single",
        "all_gather",
        "broadcast",
        "all_to_all",
        "reduce_scatter_tensor",
        "all_gather_into_tensor",
        "send",
        "recv",
    ):
        original = originals[name] = getattr(dist, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            counts[_name if _name in counts else "other"] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    try:
        return counted_step(rank, world, layers, fraction, counts)
    finally:  # the session's later runs call torch.distributed's own
        for name, original in originals.items():
            setattr(dist, name, original)


def counted_step(rank, world, layers, fraction, counts):
    """One engine step over ``layers`` layers, the collectives it calls counted in ``counts``."""
    group = dist.new_group(list(range(world)))
    hp = options.hyperparameters(fraction=fraction, **HP)
    hidden = 32
    # Q, K, V split on rows and the projection on columns share one shape; then fc1 and fc2.
    layer = [((hidden, hidden), "rows")] * 3 + [((hidden, hidden), "cols"), ((4 * hidden, hidden), "rows"), ((hidden, 4 * hidden), "cols")]
    shards = []
    gen = torch.Generator().manual_seed(0)
    for i in range(layers):
        for t, (shape, kind) in enumerate(layer):
            sharding = make_sharding(kind, *shape, world, 0)
            piece = local_piece(torch.randn(shape, generator=gen), sharding, rank)
            shards.append(MatrixShard(f"layer{i}.{t}", piece, torch.randn(piece.shape, generator=gen), shape, sharding, group, hp))
    engine = Dion3Engine(shards)
    for key in counts:
        counts[key] = 0
    engine.step()
    n_max = max(numel for numel in engine.buffer_numels)
    bound = 0
    for shape in {s for s, _ in layer}:
        per_layer = sum(1 for s, _ in layer if s == shape)
        k = rule.selected_row_count(shape[0], fraction)
        bound = max(bound, per_layer * layers * k * (shape[1] + 1))  # k rows (+ variance) of every matrix
    return dict(counts), len({s for s, _ in layer}), n_max, bound, max(math.prod(s) for s, _ in layer) * layers // world


@pytest.mark.slow
def test_collectives_per_step_do_not_grow_with_depth_and_buffers_stay_small(two_rank_runs):
    shallow, deep = two_rank_runs["counts"][0]  # rank 0's
    (c2, shapes, _, _, _), (c8, _, biggest, bound, group_share) = shallow, deep
    assert c2 == c8, (c2, c8)
    assert c8["other"] == 0
    assert c8["all_reduce"] + c8["all_to_all_single"] <= 3 * shapes
    assert c8["all_to_all_single"] == 2 * shapes
    assert c8["all_reduce"] == 1  # the row scores of every shape in one all-reduce
    # No buffer holds more than the k selected rows of each matrix of a group (the static exchange
    # sends a row block's k rows, zeros where another rank holds them): never the matrices themselves.
    assert biggest <= bound < group_share, (biggest, bound, group_share)


def engine_error(shards) -> str:
    """The error building an engine over ``shards`` raises on this rank, or "no error"."""
    try:
        Dion3Engine(shards)
    except RuntimeError as err:
        return str(err)
    return "no error"


def mismatch_worker(rank, world):
    group = dist.new_group(list(range(world)))
    hp = options.hyperparameters()
    names = ["a", "b"] if rank == 0 else ["a", "c"]
    shards = [MatrixShard(n, torch.randn(4, 8), torch.randn(4, 8), (8, 8), Sharding.even_rows(8, 2), group, hp) for n in names]
    return engine_error(shards)


@pytest.mark.slow
def test_plan_mismatch_raises_a_clear_error_quickly(two_rank_runs):
    messages, seconds = zip(*two_rank_runs["mismatch"])
    assert max(seconds) < 30
    for message in messages:
        assert "plans differ across the ranks [0, 1]" in message and "'b (8, 8)" in message and "'c (8, 8)" in message


def one_sided_worker(rank, world, case):
    """A plan that differs across the ranks of one group, as ``case`` says; returns each rank's error."""
    group = dist.new_group(list(range(world)))
    hp = options.hyperparameters()
    if case == "lr":  # the two TP shards of one logical matrix, stepped with different lr
        hp = options.hyperparameters(lr=0.01 * (rank + 1))
    split = MatrixShard("a", torch.randn(4, 8), torch.randn(4, 8), (8, 8), Sharding.even_rows(8, 2), group, hp)
    whole = MatrixShard("a", torch.randn(8, 8), torch.randn(8, 8), (8, 8), Sharding.full(), None, hp)
    # "missing": rank 1 holds the matrix whole, so it has no matrix split over the group at all.
    shards = [whole] if case == "missing" and rank == 1 else [split]
    return engine_error(shards)


@pytest.mark.slow
@pytest.mark.parametrize(
    "case, words",
    [
        (
            "missing",
            ["plans differ across the ranks [0, 1]", "rank 1 passes no matrix split over them, rank 0 does", "'a (8, 8) rows[0, 4, 8]"],
        ),
        ("lr", ["plans differ across the ranks [0, 1]", "lr=0.01", "lr=0.02"]),
    ],
)
@pytest.mark.slow
def test_a_plan_that_differs_across_a_group_raises_on_every_rank_quickly(two_rank_runs, case, words):
    # A rank without a matrix split over the group used to skip the check and hang the others; a
    # matrix stepped with different settings on its shards' ranks went unnoticed.
    messages, seconds = zip(*two_rank_runs["one sided"][case])
    assert max(seconds) < 40
    for message in messages:
        for w in words:
            assert w in message, (w, message)


def timed(fn, *args):
    """``fn(*args)`` and the seconds it took on this rank."""
    start = time.time()
    return fn(*args), time.time() - start


def two_rank_worker(rank, world, seeds):
    """The two-rank runs of the tests above on one process group (starting one costs more than
    they do); last the plans that differ across the ranks, each engine's build timed on its rank."""
    return {
        "static": {
            (kind, fraction): static_exchange_worker(rank, world, kind, fraction, seeds[kind, fraction])
            for kind, fraction, _ in STATIC_EXCHANGES
        },
        "counts": [counting_worker(rank, world, layers, 0.25) for layers in (2, 8)],
        "mismatch": timed(mismatch_worker, rank, world),
        "one sided": {case: timed(one_sided_worker, rank, world, case) for case in ("missing", "lr")},
    }


@pytest.fixture(scope="module")
def two_rank_runs():
    """The two-rank worker's results, by test and then by rank; the static exchanges' with the
    seed their inputs were drawn from (fresh in each run)."""
    seeds = {(kind, fraction): torch.seed() % 2**31 for kind, fraction, _ in STATIC_EXCHANGES}
    per_rank = run_distributed(two_rank_worker, 2, seeds, timeout=120)
    static = {key: ([out["static"][key] for out in per_rank], seed) for key, seed in seeds.items()}
    by_test = {key: [out[key] for out in per_rank] for key in ("counts", "mismatch")}
    one_sided = {case: [out["one sided"][case] for out in per_rank] for case in ("missing", "lr")}
    return {"static": static, **by_test, "one sided": one_sided}


@pytest.mark.parametrize("share", [0.0, 1.5, float("nan")])
def test_step_share_outside_0_1_is_refused(share):
    with pytest.raises(ValueError, match="step_share must be in \\(0, 1\\]"):
        Dion3Engine([], step_share=share)
