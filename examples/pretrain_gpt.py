#!/usr/bin/env python
"""Train a small Megatron-Core GPT with Dion3: the example the README runs first.

    python examples/pretrain_gpt.py                  # CPU: starts 2 processes over gloo (DP=2); ~70 s
    python examples/pretrain_gpt.py --tp 2 --query-groups 2   # CPU, tensor parallel instead
    python examples/pretrain_gpt.py --compare        # Dion3, AdamW and Muon: table, verdict, PNG plot, JSON
    python examples/pretrain_gpt.py --text-file my.txt          # byte-level, any text file
    python examples/pretrain_gpt.py --data-path /data/my_text_document --vocab-size 50304  # Megatron indexed data
    torchrun --nproc-per-node 8 examples/pretrain_gpt.py --tp 2 # GPUs: NCCL, one process per GPU

Megatron-Core's own pieces, wired as ``megatron.training.pretrain()`` wires them: GPTModel (local
layer spec, built by ``examples/small_gpt.py``), DDP with the layer-wise ZeRO-1 layout,
``get_megatron_optimizer`` with ``optimizer="dion3"`` (the entry that ``import
dion3_megatron.megatron`` registers, exactly what ``--optimizer dion3 --use-distributed-optimizer``
selects), the lr scheduler and ``forward_backward_func``. Without ``torchrun`` the script starts
its own processes: one per GPU when CUDA is available, else ``--nproc`` (2) CPU processes over gloo
with ``examples/megatron_cpu.py``.

Data (byte-level unless --data-path): by default the running Python's standard-library sources
(no download); random windows of ``--seq-length + 1`` tokens, the same for every optimizer; the
last 5% of the tokens are held out for the validation loss. Every run ends with a table and a
one-line verdict (examples/compare_report.py) and writes its JSON and PNG to --out-dir.
"""

from __future__ import annotations

import math
import os
import socket
import statistics
import subprocess
import sys
import time

import torch

from dion3_megatron.compat import require_megatron
from dion3_megatron.options import BY_NAME as DION3_OPTIONS

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the examples' own modules, also when imported by path
from compare_report import LABELS, report  # noqa: E402
from example_args import ExampleParser  # noqa: E402
from leave_process_group import leave_process_group  # noqa: E402
from megatron_quiet import quiet_megatron  # noqa: E402
from small_gpt import megatron_config, megatron_gpt  # noqa: E402
from stdlib_text import byte_tokens, stdlib_bytes  # noqa: E402

CPU_DEFAULTS = dict(layers=4, hidden=128, heads=4, ffn=352, seq_length=128, global_batch=16, steps=400)
GPU_DEFAULTS = dict(layers=8, hidden=512, heads=8, ffn=1408, seq_length=512, global_batch=64, steps=1000)
OPTIMIZERS = ("dion3", "adam", "muon")
TIMING_WARMUP = 5  # optimizer steps left out of the step time: Dion3 plans (and may capture a CUDA graph) first


def _by_device(key: str) -> str:
    return f"(default: {CPU_DEFAULTS[key]} on CPU, {GPU_DEFAULTS[key]} on GPUs)"


def parse_args(argv=None):
    p = ExampleParser(description=__doc__.splitlines()[0], other_spellings={"--fraction": "--dion3-fraction"})
    g = p.add_argument_group("run")
    g.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: CUDA (NCCL) when available, else CPU (gloo) (default: %(default)s)",
    )
    g.add_argument("--nproc", type=int, default=None, help="processes to start when not under torchrun (default: one per GPU, or 2 on CPU)")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size; data-parallel = world / tp (default: %(default)s)")
    g.add_argument("--compare", action="store_true", help="train Dion3, AdamW and Muon on the same data and steps")
    g.add_argument(
        "--optimizers", default=None, help=f"comma-separated subset of {','.join(OPTIMIZERS)} (default: dion3, or all with --compare)"
    )
    g.add_argument(
        "--out-dir",
        default=os.path.join("runs", "pretrain_gpt"),
        help="every run writes its results here: compare.json and compare.png with --compare, else "
        "<optimizers>.json / .png, e.g. dion3.json (default: %(default)s)",
    )
    g.add_argument("--log-interval", type=int, default=None, help="log loss and tokens/s every N steps (default: a tenth of the steps)")
    g.add_argument(
        "--eval-interval", type=int, default=None, help="validation loss every N steps, and at the end (default: a fifth of the steps)"
    )
    g.add_argument("--eval-batches", type=int, default=4, help="global batches in each validation pass (default: %(default)s)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar (none either when stderr is not a terminal)")
    g.add_argument(
        "--seed", type=int, default=1234, help="seed of the weights' initialization and of the training windows (default: %(default)s)"
    )
    m = p.add_argument_group("model and batch (defaults depend on the device: CPU tiny, GPU small)")
    m.add_argument("--layers", type=int, help=f"transformer layers {_by_device('layers')}")
    m.add_argument("--hidden", type=int, help=f"hidden size {_by_device('hidden')}")
    m.add_argument("--heads", type=int, help=f"attention heads {_by_device('heads')}")
    m.add_argument(
        "--query-groups",
        type=int,
        help="key/value head groups (GQA): a divisor of --heads and a multiple of --tp (default: "
        "--heads / 4 where 4 divides it, else --heads)",
    )
    m.add_argument("--ffn", type=int, help=f"SwiGLU hidden size {_by_device('ffn')}")
    m.add_argument("--seq-length", type=int, help=f"tokens per sequence {_by_device('seq_length')}")
    m.add_argument("--global-batch", type=int, help=f"sequences per step, split over data-parallel ranks {_by_device('global_batch')}")
    m.add_argument("--steps", type=int, help=f"optimizer steps {_by_device('steps')}")
    o = p.add_argument_group("optimizer")

    def library_option(flag: str, name: str, text: str) -> None:
        """A flag that takes a Dion3 option, with the spec's check and default."""
        option = DION3_OPTIONS[name]
        o.add_argument(flag, type=option.argparse_type(), default=option.default, help=f"{text} (default: the library's, %(default)s)")

    library_option("--lr", "lr", "Dion3's matrices at f = 1 (f < 1 steps at up to 4x), and norms, as Megatron does")
    o.add_argument("--muon-lr", type=float, default=0.0025, help="the Muon run's matrices (and norms) (default: %(default)s)")
    library_option(
        "--decoupled-lr",
        "adamw_lr",
        "the Dion3 run's embeddings and output layer, which take AdamW: Megatron's --decoupled-lr, Dion3's adamw_lr",
    )
    o.add_argument(
        "--adam-lr", type=float, default=3e-3, help="the AdamW run, and the Muon run's embeddings and output layer (default: %(default)s)"
    )
    library_option("--weight-decay", "weight_decay", "decoupled weight decay")
    o.add_argument(
        "--clip-grad", type=float, default=1.0, help="gradient clipping: the global norm's limit, 0 for none (default: %(default)s)"
    )
    library_option(
        "--dion3-fraction", "fraction", "Dion3's f: in (0, 1], or 'auto', chosen per matrix from its shape and this machine's speed"
    )
    d = p.add_argument_group("data (default: the Python standard library's sources, byte-level)")
    d.add_argument("--text-file", help="train on this text file, byte-level (vocab 256)")
    d.add_argument("--data-path", help="Megatron indexed dataset prefix (PREFIX.bin / PREFIX.idx)")
    d.add_argument("--vocab-size", type=int, help="with --data-path (default: largest token id + 1)")
    d.add_argument("--max-tokens", type=int, default=8_000_000, help="read at most this many tokens (default: %(default)s)")
    p.error = lambda message: p.exit(2, f"{p.prog}: error: {message}\n")  # one line, as check_args' own
    args = p.parse_args(argv)
    check_args(args, p.error)
    return args


def check_args(args, fail) -> None:
    """Every argument and path, in this process before any worker starts: ``fail(message)`` gets
    one line naming the flag and the value. Fills the device's model and batch defaults."""
    if args.text_file and args.data_path:
        fail("--text-file and --data-path are exclusive")
    if args.optimizers is None:
        args.optimizers = ",".join(OPTIMIZERS) if args.compare else "dion3"
    names = [n.strip() for n in args.optimizers.split(",") if n.strip()]
    bad = [n for n in names if n not in OPTIMIZERS]
    if bad or not names:
        fail(f"--optimizers: unknown {bad}; choose from {','.join(OPTIMIZERS)}")
    args.optimizers = names
    cuda = _use_cuda(args)
    if cuda and not torch.cuda.is_available():
        fail("--device cuda: no CUDA device is available")
    for key, value in (GPU_DEFAULTS if cuda else CPU_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in (
        "nproc",
        "tp",
        "layers",
        "hidden",
        "heads",
        "query_groups",
        "ffn",
        "seq_length",
        "global_batch",
        "steps",
        "eval_batches",
        "max_tokens",
        "log_interval",
        "eval_interval",
        "vocab_size",
    ):
        value = getattr(args, key)
        if value is not None and value < 1:
            fail(f"--{key.replace('_', '-')} must be at least 1, got {value}")
    for key in ("muon_lr", "adam_lr", "clip_grad"):
        value = getattr(args, key)
        if not (math.isfinite(value) and value >= 0):
            fail(f"--{key.replace('_', '-')} must be a finite number >= 0, got {value}")
    world = int(os.environ.get("WORLD_SIZE", 0)) or args.nproc or (torch.cuda.device_count() if cuda else 2)
    if world % args.tp:
        fail(f"--tp {args.tp} must divide the number of processes, {world}")
    if args.heads % args.tp:
        fail(f"--tp {args.tp} must divide --heads {args.heads}")
    # Megatron splits the query groups over the tensor-parallel ranks: the model never changes with --tp.
    source = "--query-groups" if args.query_groups is not None else f"--heads {args.heads} / 4"
    if args.query_groups is None:
        args.query_groups = args.heads // 4 if args.heads % 4 == 0 else args.heads
    if args.heads % args.query_groups:
        fail(f"--query-groups {args.query_groups} must divide --heads {args.heads}")
    if args.query_groups % args.tp:
        fits = next(g for g in range(args.tp, args.heads + 1, args.tp) if args.heads % g == 0)
        fail(
            f"--tp {args.tp} must divide the query groups, {args.query_groups} ({source}): give --query-groups "
            f"{fits} (a multiple of --tp {args.tp} that divides --heads {args.heads}), also at TP=1 for the "
            "same model"
        )
    if args.global_batch % (world // args.tp):
        fail(
            f"--global-batch {args.global_batch} must divide by the data-parallel size {world // args.tp} "
            f"({world} processes / --tp {args.tp})"
        )
    if args.text_file and not os.path.isfile(args.text_file):
        fail(f"--text-file {args.text_file}: no such file")
    if args.data_path:
        missing = [f"{args.data_path}{ext}" for ext in (".bin", ".idx") if not os.path.isfile(args.data_path + ext)]
        if missing:
            fail(f"--data-path {args.data_path}: no {' or '.join(missing)} (give the prefix of PREFIX.bin / PREFIX.idx)")


# ------------------------------------------------------------------------------------------------
# Launch: under torchrun, or start the processes ourselves.


def _use_cuda(args) -> bool:
    return args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, argv) -> int:
    """Start ``nproc`` copies of this script with torchrun's environment; rank 0 prints."""
    cuda = _use_cuda(args)
    nproc = args.nproc or (torch.cuda.device_count() if cuda else 2)
    port = _free_port()
    procs = []
    for rank in range(nproc):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(nproc),
            LOCAL_WORLD_SIZE=str(nproc),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv], env=env))
    rc = 0
    try:
        while procs:
            for proc in list(procs):
                code = proc.poll()
                if code is None:
                    continue
                procs.remove(proc)
                if code != 0 and rc == 0:
                    rc = code
                    for other in procs:  # one rank failed: the others would wait forever
                        other.terminate()
            time.sleep(0.1)
    except KeyboardInterrupt:
        for proc in procs:
            proc.terminate()
        rc = 130
    return rc


# ------------------------------------------------------------------------------------------------
# Data


def stdlib_corpus(max_bytes: int) -> bytes:
    try:
        return stdlib_bytes(max_bytes)
    except FileNotFoundError as err:
        raise SystemExit(f"{err}: use --text-file or --data-path") from None


def load_tokens(args) -> tuple[torch.Tensor, int, str]:
    """(1-D int64 tokens, vocab size, description)."""
    if args.data_path:
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        ds = IndexedDataset(args.data_path)
        parts, total = [], 0
        for i in range(len(ds)):
            doc = torch.from_numpy(ds[i].astype("int64"))
            parts.append(doc)
            total += doc.numel()
            if total >= args.max_tokens:
                break
        tokens = torch.cat(parts)[: args.max_tokens]
        vocab = args.vocab_size or int(tokens.max()) + 1
        if int(tokens.max()) >= vocab:
            raise SystemExit(f"--vocab-size {vocab} but the data holds token id {int(tokens.max())}")
        return tokens, vocab, f"Megatron indexed dataset {args.data_path} ({len(ds)} sequences)"
    if args.text_file:
        with open(args.text_file, "rb") as f:
            data = f.read(args.max_tokens)
        desc = f"text file {args.text_file}"
    else:
        data = stdlib_corpus(args.max_tokens)
        desc = f"Python {sys.version.split()[0]} standard-library sources"
    return byte_tokens(data), 256, desc + " (byte-level)"


class Batches:
    """Random training windows and fixed validation windows, identical on every rank and run."""

    def __init__(self, tokens: torch.Tensor, seq: int, global_batch: int, seed: int):
        n_val = max(len(tokens) // 20, (seq + 1) * 2)
        if len(tokens) - n_val < (seq + 1) * 2:
            raise SystemExit(f"only {len(tokens)} tokens: too few for --seq-length {seq}")
        self.train, self.val = tokens[:-n_val], tokens[-n_val:]
        self.seq, self.global_batch, self.seed = seq, global_batch, seed

    def _windows(self, data: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        return torch.stack([data[s : s + self.seq + 1] for s in starts.tolist()])

    def train_batches(self):
        gen = torch.Generator().manual_seed(self.seed)
        while True:
            yield self._windows(self.train, torch.randint(0, len(self.train) - self.seq - 1, (self.global_batch,), generator=gen))

    def val_batches(self, count: int) -> list[torch.Tensor]:
        n = count * self.global_batch
        starts = torch.linspace(0, len(self.val) - self.seq - 1, n).long()
        return list(self._windows(self.val, starts).split(self.global_batch))


# ------------------------------------------------------------------------------------------------
# One training run


def optimizer_config(args, name: str, cuda: bool):
    """Megatron's OptimizerConfig of one run: Dion3 at the library's defaults unless a flag sets
    them (its lr, the AdamW lr of its embeddings and output layer, weight decay, f); Muon and AdamW
    at the script's own lrs."""
    from megatron.core.optimizer import OptimizerConfig

    lr = {"adam": args.adam_lr, "muon": args.muon_lr}.get(name, args.lr)
    decoupled = {"adam": None, "muon": args.adam_lr}.get(name, args.decoupled_lr)
    # In fp32, Megatron 0.19's layer-wise wrapper chains Muon's raw torch optimizer, whose missing
    # .config fails ChainedOptimizer's assertion (dion3's wrapper adds FP32Optimizer). So Muon's
    # *optimizer* config says bf16 on CPU too: Megatron's bf16 wrapper then steps the fp32 model
    # params in place (its fp32_from_fp32 groups: no copies, fp32 math).
    ocfg = OptimizerConfig(
        optimizer=name,
        lr=lr,
        min_lr=lr / 10,
        weight_decay=args.weight_decay,
        bf16=cuda or name == "muon",
        clip_grad=args.clip_grad,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_eps=1e-8,
        use_distributed_optimizer=True,
        use_layer_wise_distributed_optimizer=name != "adam",
        decoupled_lr=decoupled,
        decoupled_min_lr=None if decoupled is None else decoupled / 10,
    )
    if name == "dion3":
        ocfg.dion3_fraction = args.dion3_fraction
    return ocfg


def build(args, name: str, vocab: int, device: torch.device, cuda: bool):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.training.training import wrap_model_chunks_with_ddp

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)
    config = megatron_config(
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        query_groups=args.query_groups,
        ffn=args.ffn,
        tp=args.tp,
        dtype=torch.bfloat16 if cuda else torch.float32,
    )  # bf16 is slow on CPU
    padded_vocab = math.ceil(vocab / (128 * args.tp)) * 128 * args.tp
    model = megatron_gpt(config, padded_vocab, args.seq_length)
    model.to(device)
    # Emerging optimizers (dion3, muon) get Megatron's layer-wise ZeRO-1, as --use-distributed-optimizer
    # gives them in pretrain().
    layer_wise = name != "adam"
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    chunks = wrap_model_chunks_with_ddp([model], config, ddp_config, use_layer_wise_distributed_optimizer=layer_wise)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = chunks[0].no_sync
    ocfg = optimizer_config(args, name, cuda)
    opt = get_megatron_optimizer(ocfg, chunks)
    lr = ocfg.lr
    warmup = max(1, args.steps // 20)
    sched = OptimizerParamScheduler(
        opt,
        init_lr=0.0,
        max_lr=lr,
        min_lr=lr / 10,
        lr_warmup_steps=warmup,
        lr_decay_steps=args.steps,
        lr_decay_style="cosine",
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.steps,
        wd_incr_style="constant",
    )
    n_params = sum(
        p.numel() * (args.tp if getattr(p, "tensor_model_parallel", False) else 1) for p in model.parameters()
    )  # the whole model's, not this TP rank's
    return chunks, opt, sched, n_params, "layer-wise ZeRO-1" if layer_wise else "ZeRO-1"


def dion3_fractions(opt) -> dict[tuple[int, int], float]:
    """{matrix shape (rows, cols): f} over the whole model as the steps use them (what "auto" chose
    included), gathered from every rank's Dion3 optimizers (layer-wise ZeRO-1 gives each rank some
    of the matrices). Collective; after the first step, which builds Dion3's engine."""
    import torch.distributed as dist
    from dion3_megatron.megatron.wrappers import dion3_optimizers

    mine = {shape: f for o in dion3_optimizers(opt) for group in o.param_groups for p in group["params"] for shape, f in o.fractions_of(p)}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {shape: f for d in everyone for shape, f in sorted(d.items())}


def describe_fractions(fractions: dict[tuple[int, int], float], setting: float | str) -> str:
    """One line: "Dion3: f=0.25 on every matrix (rows x cols: ...)", or f per shape when they differ;
    with --dion3-fraction auto it says that auto chose them."""
    shapes = sorted(fractions)
    values = set(fractions.values())
    how = "fraction=auto chose f" if setting == "auto" else "f"
    if len(values) == 1:
        return f"Dion3: {how}={values.pop():g} on every matrix (rows x cols: {', '.join(f'{n}x{m}' for n, m in shapes)})"
    return f"Dion3: {how} per matrix (rows x cols: f) " + ", ".join(f"{n}x{m}: {fractions[n, m]:g}" for n, m in shapes)


def train(args, name: str, data: Batches, vocab: int, device: torch.device, cuda: bool) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    rank0 = dist.get_rank() == 0
    chunks, opt, sched, n_params, mode = build(args, name, vocab, device, cuda)
    fractions = {}  # Dion3's f per matrix shape, read after its first step
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    micro = args.global_batch // dp
    fwd_bwd = get_forward_backward_func()
    pos = torch.arange(args.seq_length, device=device).unsqueeze(0)

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        out = model(b[:, :-1], pos.expand(b.shape[0], -1), None, labels=b[:, 1:])

        def loss_func(o):
            loss = o.float().mean()
            return loss, {"loss": loss.detach()}

        return out, loss_func

    def run(batch, forward_only):
        local = batch.chunk(dp)[dp_rank].to(device)
        out = fwd_bwd(
            forward_step_func=forward_step,
            data_iterator=iter([local]),
            model=chunks,
            num_microbatches=1,
            seq_length=args.seq_length,
            micro_batch_size=micro,
            forward_only=forward_only,
        )
        loss = out[0]["loss"].float().clone()
        dist.all_reduce(loss)  # TP ranks hold the same loss; average over all ranks = over DP
        return loss.item() / dist.get_world_size()

    val_batches = data.val_batches(args.eval_batches)

    def validate():
        for c in chunks:
            c.eval()
        with torch.no_grad():
            loss = sum(run(b, True) for b in val_batches) / len(val_batches)
        for c in chunks:
            c.train()
        return loss

    if rank0:
        print(
            f"[{LABELS[name]}] {n_params / 1e6:.2f}M parameters, {mode}, "
            f"TP={args.tp} DP={dp}, {args.steps} steps of {args.global_batch}x{args.seq_length} tokens",
            flush=True,
        )
    bar = None
    # A bar only on a terminal: piped to a file, each redraw would append (the log lines remain).
    if rank0 and not args.no_progress and sys.stderr.isatty():
        try:
            from tqdm import tqdm  # the [examples] extra; without it, the log lines alone
        except ImportError:
            tqdm = None
        if tqdm is not None:
            bar = tqdm(total=args.steps, desc=LABELS[name], dynamic_ncols=True, leave=True)
    log = bar.write if bar is not None else (lambda s: print(s, flush=True))
    tokens_per_step = args.global_batch * args.seq_length
    train_losses, val_losses, skipped = [], [], 0
    step_ms, train_time = [], []  # optimizer.step() times; training seconds (validation excluded) after each step
    batches = data.train_batches()
    t_start = time.perf_counter()
    t_window, steps_window = t_start, 0
    for step in range(1, args.steps + 1):
        batch = next(batches)
        for c in chunks:
            c.zero_grad_buffer()
        opt.zero_grad()
        loss = run(batch, False)
        ok, elapsed = timed_step(opt, cuda)
        step_ms.append(elapsed * 1e3)
        train_time.append(round(time.perf_counter() - t_start, 3))
        if ok:  # as Megatron-LM's train_step: a skipped step does not advance the schedule
            sched.step(1)
        skipped += 0 if ok else 1
        if step == 1 and name == "dion3":  # every rank: a collective
            fractions = dion3_fractions(opt)
            if rank0:
                log(describe_fractions(fractions, args.dion3_fraction))
        train_losses.append(round(loss, 5))
        steps_window += 1
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}")
        if step % args.log_interval == 0 or step == args.steps:
            now = time.perf_counter()  # timed_step synchronized the device
            tps = steps_window * tokens_per_step / (now - t_window)
            t_window, steps_window = now, 0
            if rank0:
                recent = train_losses[-args.log_interval :]
                log(
                    f"[{LABELS[name]}] step {step:5d}/{args.steps} | loss {sum(recent) / len(recent):.4f} | "
                    f"lr {opt.param_groups[0]['lr']:.2e} | {tps:,.0f} tokens/s"
                )
        if step % args.eval_interval == 0 and step != args.steps:
            t_eval = time.perf_counter()
            val_losses.append((step, round(validate(), 5)))
            if rank0:
                log(f"[{LABELS[name]}] step {step:5d}/{args.steps} | validation loss {val_losses[-1][1]:.4f}")
            t_start += time.perf_counter() - t_eval  # tokens/s counts training only
            t_window += time.perf_counter() - t_eval
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t_start
    val_losses.append((args.steps, round(validate(), 5)))
    if bar is not None:
        bar.close()
    tail = train_losses[-max(1, args.steps // 10) :]
    warm = min(TIMING_WARMUP, args.steps // 2)
    result = dict(
        optimizer=name,
        label=LABELS[name],
        mode=mode,
        parameters=n_params,
        dion3_fractions={f"{n}x{m}": f for (n, m), f in fractions.items()},
        train_loss=train_losses,
        train_time=train_time,
        val_loss=val_losses,
        final_train_loss=round(sum(tail) / len(tail), 5),
        final_train_steps=len(tail),
        final_val_loss=val_losses[-1][1],
        optimizer_ms=round(statistics.median(step_ms[warm:]), 3),
        optimizer_ms_from_step=warm + 1,
        train_seconds=round(seconds, 2),
        tokens_per_s=round(args.steps * tokens_per_step / seconds, 1),
        skipped_steps=skipped,
    )
    if rank0:
        print(
            f"[{LABELS[name]}] final validation loss {result['final_val_loss']:.4f} "
            f"(train {result['final_train_loss']:.4f}), {result['tokens_per_s']:,.0f} tokens/s, "
            f"optimizer step {result['optimizer_ms']:.2f} ms, {seconds:.1f} s",
            flush=True,
        )
    return result


def timed_step(opt, cuda: bool) -> tuple[bool, float]:
    """Megatron's optimizer.step() (grad copy, clip, update, param all-gather): (stepped, seconds),
    the device synchronized on both sides so that the time is the step's own."""
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    ok, _, _ = opt.step()
    if cuda:
        torch.cuda.synchronize()
    return ok, time.perf_counter() - start


def muon_unavailable() -> str | None:
    """Why Megatron's Muon cannot run here, or None."""
    try:
        import emerging_optimizers  # noqa: F401
    except ImportError as e:
        return (
            f"Megatron's Muon needs the 'emerging-optimizers' package ({e}); "
            "pip install emerging-optimizers (it is in dion3-megatron's [megatron] extra)"
        )
    return None


# ------------------------------------------------------------------------------------------------


def quiet() -> None:
    """Megatron's warnings and loggers quietened (examples/megatron_quiet.py), the library's warnings shown."""
    import logging

    quiet_megatron()
    # The library's warnings, not its INFO line on what fraction=auto chose (rank 0's matrices): train()
    # prints every rank's f per matrix after the first step.
    library = logging.getLogger("dion3_megatron")
    library.setLevel(logging.WARNING)
    library.addHandler(logging.StreamHandler(sys.stdout))
    library.propagate = False  # Megatron configures the root logger too: print once


def worker(args) -> None:
    import torch.distributed as dist

    quiet()

    cuda = _use_cuda(args)
    world = int(os.environ["WORLD_SIZE"])
    if cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl")
    else:
        from megatron_cpu import install

        install()
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        torch.set_num_threads(max(1, cores // local_world))
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    import dion3_megatron.megatron  # noqa: F401 - registers optimizer="dion3" with Megatron-Core

    args.log_interval = args.log_interval or max(1, args.steps // 10)
    args.eval_interval = args.eval_interval or max(1, args.steps // 5)
    rank0 = dist.get_rank() == 0
    tokens, vocab, desc = load_tokens(args)
    data = Batches(tokens, args.seq_length, args.global_batch, args.seed)
    meta = dict(
        model=f"GPT {args.layers}x{args.hidden}, seq {args.seq_length}",
        data=desc,
        tokens=len(tokens),
        vocab=vocab,
        world=world,
        tp=args.tp,
        dp=world // args.tp,
        device="cuda" if cuda else "cpu",
        steps=args.steps,
        global_batch=args.global_batch,
        lr=args.lr,
        muon_lr=args.muon_lr,
        adam_lr=args.adam_lr,
        decoupled_lr=args.decoupled_lr,
        dion3_fraction=args.dion3_fraction,
    )
    if rank0:
        print(
            f"data: {desc}: {len(data.train):,} training / {len(data.val):,} validation tokens, vocab {vocab}; "
            f"{'CUDA (NCCL)' if cuda else 'CPU (gloo)'}, {world} processes",
            flush=True,
        )
    results, skipped = [], {}
    for name in args.optimizers:
        why = muon_unavailable() if name == "muon" else None
        if why:
            skipped[name] = why
            if rank0:
                print(f"[Muon] skipped: {why}", flush=True)
            continue
        try:
            results.append(train(args, name, data, vocab, device, cuda))
        except Exception as e:  # noqa: BLE001 - with --compare, report and go on with the next optimizer
            if not args.compare:
                raise
            import traceback

            traceback.print_exc()
            results.append(dict(optimizer=name, label=LABELS[name], error=f"{type(e).__name__}: {e}"[:500]))
    if rank0:
        report(args, results, skipped, meta)
    leave_process_group()
    if any("error" in r for r in results):
        raise SystemExit(1)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    require_megatron()  # before any process starts, the error that names the install command
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return launch(args, argv)
    worker(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
