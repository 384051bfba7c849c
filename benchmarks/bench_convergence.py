"""Convergence benchmark: Dion3 against Muon, NorMuon and AdamW on a byte-level GPT.

The protocol: a corpus of the installation's own source code
that is never repeated within a run (benchmarks/convergence_corpus.py, its SHA-256 recorded), two
model sizes (``--size small``: 10.6M block-matrix parameters; ``--size medium``: 48.3M), at least
``--tokens-per-param`` (10) tokens per parameter, the same initial weights per seed, the same data
per seed, the same schedule and the same AdamW for the embedding, head and norm gains in every run.
The optimizers differ only on the block matrices (Q, K, V, O, gate, up, down):

  dion3     dion3_megatron.Dion3 (Gram NS) at fraction f, the other parameters in an adamw group
  normuon   the Dion3 rule at f = 1 with standard NS: NorMuon with heavy-ball momentum
  muon      torch.optim.Muon (Nesterov, momentum 0.95) + torch AdamW
  adamw     torch.optim.AdamW for everything (the matrices at the swept lr)

A config is ``opt[:key=value]...``. Keys: lr (a number, or "best": the best lr of ``--best-ref``'s
finished runs), wd, seed, and for dion3/normuon the rule's options (OPTION_KEYS): f (a fraction or
"auto"), mu, mu_by_f, lr_by_f (0/1 each), stale, mom (fp32 or bf16: the momentum's storage),
and fwarm (the share of steps run at f = 1 before switching to f); a key left out takes the
reference rule's value (mu 0.95, no scaling, no staleness, fp32), not the library's default. A config's family is the config without lr
and seed.

  python benchmarks/bench_convergence.py --size small --configs muon:lr=0.025 dion3:f=0.25:lr=0.04 --extend --seeds 2
  python benchmarks/bench_convergence.py --plot-only a.json b.json --json merged.json --png merged.png

``--extend`` adds, per family, the next lr on the 2x grid beyond the best one while the best is at
an edge of the lrs tried; ``--seeds N`` then repeats each family's best lr with seeds 1..N-1.
``--merge`` (or --plot-only) takes earlier results of the same settings and corpus: what they
hold is not run again, and the output holds everything.

Runs train as packs (``--pack``): K members trained side by side as one batched computation
(benchmarks/convergence_model.py), each with its own optimizer, stepped one after the other. Each
member's optimizer time is measured after its training, alone (the step() of one model on fresh
random gradients, synchronized before and after: in a pack, CUDA events around one member's step
also caught its neighbours' queued work and the host's launch gaps); the
single-run step time is the forward, backward and clipping time of one model alone (measured once
per invocation, ``--timing-steps``) plus that optimizer time, and the loss-against-time panel uses
it.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Optional

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import convergence_corpus as corpus_lib  # noqa: E402
from benchmarks.convergence_model import GPT, pack_loss, split_params  # noqa: E402
from dion3_megatron import Dion3  # noqa: E402

OPTIMIZERS = ("dion3", "normuon", "muon", "adamw")
LABELS = {"dion3": "Dion3 f={f}", "normuon": "NorMuon (Dion3 f=1, std NS)", "muon": "Muon (torch.optim.Muon)", "adamw": "AdamW"}
DEFAULT_WD = {"dion3": 0.01, "normuon": 0.01, "muon": 0.01, "adamw": 0.1}
DEFAULT_LR = {"dion3": 0.02, "normuon": 0.02, "muon": 0.025, "adamw": 0.003}


def _one_of(value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"must be one of {choices}, got {value!r}")
    return value


# Dion3 rule options a config may set: key -> (Dion3 keyword, parser, value when the config does not
# set it). The values are the reference rule's (microsoft/dion's NorDion2), passed explicitly, so a
# config names the same rule whatever the library's defaults are.
OPTION_KEYS = {
    "mu": ("mu", float, 0.95),
    "mu_by_f": ("scale_mu_by_fraction", lambda v: bool(int(v)), False),
    "lr_by_f": ("scale_lr_by_fraction", lambda v: bool(int(v)), False),
    "stale": ("staleness", float, 0.0),
    "mom": ("momentum_dtype", lambda v: _one_of(v, ("fp32", "bf16")), "fp32"),  # the momentum's storage
    "fwarm": (None, float, 0.0),  # the benchmark's f schedule, not a Dion3 keyword
}
SIZES = {
    "small": dict(layers=6, hidden=384, heads=6, ffn=1024, seq=512, batch=128),
    "medium": dict(layers=10, hidden=640, heads=10, ffn=1664, seq=512, batch=256),
    # A CPU screening proxy of the protocol (0.47M parameters, 2,284 steps; a pack of 6 in ~20 min on
    # 2 cores with --device cpu --no-bf16 --stdlib-only): it reproduces the protocol's large effects,
    # but the difference between two settings paired by seed moves by 0.01-0.05 from seed to seed:
    # pair three seeds or more.
    "proxy": dict(layers=2, hidden=128, heads=4, ffn=352, seq=64, batch=32),
}
MARGINS = {0.25: 0.01, 0.125: 0.02}  # Dion3 f: the final validation loss above Muon's (mean of seeds) it reports within


# ------------------------------------------------------------------------------------------------
# Configs.


def fraction_text(f) -> str:
    if f == "auto":
        return "auto"
    inv = 1 / f
    return f"1/{round(inv)}" if abs(inv - round(inv)) < 1e-9 and f < 1 else f"{f:g}"


def parse_config(text: str) -> dict:
    """``dion3:f=0.25:mu=0.8:lr=0.02`` -> the config dict (opt, f, lr, wd, seed, options, family, name)."""
    parts = text.strip().split(":")
    opt = parts[0]
    if opt not in OPTIMIZERS:
        raise ValueError(f"config {text!r}: the optimizer must be one of {OPTIMIZERS}")
    cfg: dict = {
        "opt": opt,
        "f": 1.0 if opt == "normuon" else (0.25 if opt == "dion3" else None),
        "lr": DEFAULT_LR[opt],
        "wd": DEFAULT_WD[opt],
        "seed": 0,
        "options": {},
    }
    for part in parts[1:]:
        key, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"config {text!r}: expected key=value, got {part!r}")
        try:
            if key == "f":
                if opt != "dion3":
                    raise ValueError("only dion3 takes f")
                cfg["f"] = "auto" if value == "auto" else float(value)
                if cfg["f"] != "auto" and not 0 < cfg["f"] <= 1:
                    raise ValueError("f must be in (0, 1] or auto")
            elif key == "lr":
                cfg["lr"] = "best" if value == "best" else float(value)
            elif key in ("wd", "seed"):
                cfg[key] = float(value) if key == "wd" else int(value)
            elif key in OPTION_KEYS:
                if opt not in ("dion3", "normuon"):
                    raise ValueError(f"{key} is for dion3 and normuon only")
                cfg["options"][key] = OPTION_KEYS[key][1](value)
            else:
                raise ValueError(f"unknown key {key!r} (f, lr, wd, seed, {', '.join(OPTION_KEYS)})")
        except ValueError as error:
            raise ValueError(f"config {text!r}: {error}") from None
    fwarm = cfg["options"].get("fwarm", 0.0)
    if not 0 <= fwarm < 1:
        raise ValueError(f"config {text!r}: fwarm must be in [0, 1)")
    cfg["options"] = {k: v for k, v in cfg["options"].items() if v != OPTION_KEYS[k][2]}
    return named(cfg)


def named(cfg: dict) -> dict:
    """cfg with its family (everything but lr and seed) and name filled in."""
    parts = [cfg["opt"]] + ([f"f={cfg['f']}"] if cfg["opt"] == "dion3" else [])
    parts += [
        f"{k}={int(v)}" if isinstance(v, bool) else f"{k}={v}" if isinstance(v, str) else f"{k}={v:g}"
        for k, v in sorted(cfg["options"].items())
    ]
    if cfg["wd"] != DEFAULT_WD[cfg["opt"]]:
        parts.append(f"wd={cfg['wd']:g}")
    family = ":".join(parts)
    lr = f"lr={cfg['lr']:g}" if cfg["lr"] != "best" else "lr=best"
    return dict(cfg, family=family, name=f"{family}:{lr}" + (f":seed={cfg['seed']}" if cfg["seed"] else ""))


def label(cfg: dict) -> str:
    text = LABELS[cfg["opt"]].format(f=fraction_text(cfg["f"])) if cfg["opt"] == "dion3" else LABELS[cfg["opt"]]
    extras = {
        "mu": "mu {:g}",
        "mu_by_f": "mu^(1/f)",
        "lr_by_f": "lr/max(f, 1/4)",
        "stale": "staleness {:g}",
        "mom": "{} momentum",
        "fwarm": "f=1 for {:.0%} of steps",
    }
    words = [extras[k].format(v) for k, v in sorted(cfg["options"].items())]
    if cfg["wd"] != DEFAULT_WD[cfg["opt"]]:
        words.append(f"wd {cfg['wd']:g}")
    return text + (", " + ", ".join(words) if words else "")


# ------------------------------------------------------------------------------------------------
# Optimizers and schedule.


def build_optimizer(cfg: dict, model: GPT, args) -> list[torch.optim.Optimizer]:
    matrices, others = split_params(model)
    aux = dict(lr=args.aux_lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=args.aux_wd)
    opt, lr, wd = cfg["opt"], cfg["lr"], cfg["wd"]
    if opt in ("dion3", "normuon"):
        rule = {keyword: cfg["options"].get(key, default) for key, (keyword, _, default) in OPTION_KEYS.items() if keyword}
        dion = dict(lr=lr, fraction=cfg["f"], beta2=0.95, weight_decay=wd, ns_method="gram" if opt == "dion3" else "standard", **rule)
        return [Dion3([{"params": matrices}, {"params": others, "algorithm": "adamw", **aux}], **dion)]
    if opt == "muon":
        return [torch.optim.Muon(matrices, lr=lr, weight_decay=wd, momentum=0.95, nesterov=True), torch.optim.AdamW(others, **aux)]
    return [
        torch.optim.AdamW(
            [{"params": matrices, "lr": lr, "weight_decay": wd}, {"params": others, **aux}], lr=lr, betas=(0.9, 0.95), eps=1e-8
        )
    ]


def lr_multiplier(step: int, steps: int, warmup: int, final: float) -> float:
    """Linear warmup to 1 over ``warmup`` steps, then cosine to ``final``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - 1 - warmup)
    return final + (1 - final) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def fraction_at(cfg: dict, step: int, steps: int):
    """The Dion3 fraction at ``step``: 1 during the config's fwarm share of the run, then f."""
    return 1.0 if step < cfg["options"].get("fwarm", 0.0) * steps else cfg["f"]


# ------------------------------------------------------------------------------------------------
# Training a pack.


def model_config(args) -> dict:
    return dict(d=args.hidden, layers=args.layers, heads=args.heads, ffn=args.ffn, seq=args.seq)


def member(cfg: dict, args, device: torch.device) -> GPT:
    torch.manual_seed(args.seed + cfg["seed"])
    return GPT(**model_config(args)).to(device)


def windows(tokens: torch.Tensor, starts: torch.Tensor, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """starts (...,) -> inputs and targets (..., seq) as int64."""
    w = tokens[starts.unsqueeze(-1) + torch.arange(seq + 1, device=tokens.device)].long()
    return w[..., :-1], w[..., 1:]


@torch.no_grad()
def evaluate(models: list[GPT], val: torch.Tensor, starts: torch.Tensor, args) -> list[float]:
    """Mean validation loss of each member over the same held-out windows."""
    total = torch.zeros(len(models), device=val.device)
    for chunk in starts.split(args.batch):
        x, y = windows(val, chunk.to(val.device), args.seq)
        total += pack_loss(models, x.expand(len(models), -1, -1), y.expand(len(models), -1, -1), args.bf16, args.compile)
    return (total / math.ceil(len(starts) / args.batch)).tolist()


def run_pack(cfgs: list[dict], args, corpus: corpus_lib.Corpus, log=print, on_eval=None) -> list[dict]:
    """Train the configs side by side (one member each); one record per config. ``on_eval`` gets
    the records so far (marked partial) after every evaluation, so a killed job keeps them."""
    device = torch.device(args.device)
    train, val = corpus.train.to(device), corpus.val.to(device)
    starts = torch.stack([corpus_lib.lane_starts(len(corpus.train), args.batch, args.seq, args.steps, c["seed"]) for c in cfgs], dim=1).to(
        device
    )  # (steps, K, batch)
    val_starts = corpus_lib.val_starts(len(corpus.val), args.seq, args.eval_batches * args.batch)
    models = [member(c, args, device) for c in cfgs]
    optimizers = [build_optimizer(c, m, args) for c, m in zip(cfgs, models)]
    base_lrs = [[[g["lr"] for g in o.param_groups] for o in opts] for opts in optimizers]
    warmup = max(1, round(args.warmup_frac * args.steps))
    eval_every = args.eval_every or max(1, args.steps // 10)
    trained = [0] * len(cfgs)
    losses = torch.zeros(args.steps, len(cfgs), device=device)
    curves = [[[0, v]] for v in evaluate(models, val, val_starts, args)]
    live = [True] * len(cfgs)
    t0 = time.perf_counter()
    log(f"pack of {len(cfgs)}: {', '.join(c['name'] for c in cfgs)}")
    for step in range(args.steps):
        mult = lr_multiplier(step, args.steps, warmup, args.final_lr_frac)
        x, y = windows(train, starts[step], args.seq)
        loss = pack_loss(models, x, y, args.bf16, args.compile)
        loss.sum().backward()
        losses[step] = loss.detach()
        for i, (cfg, model, opts) in enumerate(zip(cfgs, models, optimizers)):
            if not live[i]:
                model.zero_grad(set_to_none=True)
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            for opt, lrs in zip(opts, base_lrs[i]):
                for group, lr in zip(opt.param_groups, lrs):
                    group["lr"] = lr * mult
                    if group.get("algorithm") != "adamw" and "fraction" in group:
                        group["fraction"] = fraction_at(cfg, step, args.steps)
            for opt in opts:
                opt.step()
            trained[i] += 1
            model.zero_grad(set_to_none=True)
        done = step + 1
        if done % eval_every == 0 or done == args.steps:
            finite = torch.isfinite(losses[:done]).all(0).tolist()
            vals = evaluate(models, val, val_starts, args)
            for i in range(len(cfgs)):
                if live[i] and not finite[i]:
                    live[i] = False
                    log(f"{cfgs[i]['name']}: non-finite loss by step {done}, stopped")
                if live[i]:
                    curves[i].append([done, vals[i]])
            memory = f", {torch.cuda.max_memory_allocated(device) / 2**30:.0f} GiB" if device.type == "cuda" else ""
            log(
                f"step {done}/{args.steps} ({time.perf_counter() - t0:.0f} s{memory}) val "
                + " ".join(f"{v:.4f}" if live[i] else "diverged" for i, v in enumerate(vals))
            )
            if on_eval is not None and done < args.steps:
                on_eval(pack_records(cfgs, optimizers, models, trained, losses[:done], curves, live, args, time.perf_counter() - t0))
    wall = time.perf_counter() - t0
    timings = [time_optimizer(opts, model, args) if alive else (math.nan, math.nan) for opts, model, alive in zip(optimizers, models, live)]
    records = pack_records(cfgs, optimizers, models, trained, losses, curves, live, args, wall, timings)
    for r in records:
        log(f"{r['name']}: final val {r['final_val_loss']:.4f}, opt {r['opt_ms']:.2f} ms")
    return records


TRAIN_LOSS_EVERY = 10  # the record keeps the mean training loss of each run of this many steps


def train_loss_means(losses: torch.Tensor) -> list[float]:
    """Mean training loss of each TRAIN_LOSS_EVERY consecutive steps (the last run may be shorter):
    the validation curve is the result; this keeps the training curve's shape at a tenth of the size."""
    return [round(statistics.fmean(chunk.tolist()), 4) for chunk in losses.split(TRAIN_LOSS_EVERY)]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_optimizer(opts: list[torch.optim.Optimizer], model: GPT, args) -> tuple[float, float]:
    """(median, p90) wall ms of one step() of this model's optimizers alone, on fresh random
    gradients, synchronized before and after (the model is trained: its weights change here)."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(1)
    times = []
    for _ in range(args.timing_warmup + args.timing_steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen, device=device) * 1e-3
        _synchronize(device)
        t = time.perf_counter()
        for opt in opts:
            opt.step()
        _synchronize(device)
        times.append((time.perf_counter() - t) * 1e3)
    model.zero_grad(set_to_none=True)
    ms = sorted(times[args.timing_warmup :] or times)
    return statistics.median(ms), ms[round(0.9 * (len(ms) - 1))]


def pack_records(
    cfgs, optimizers, models, trained, losses, curves, live, args, wall: float, timings: list[tuple[float, float]] | None = None
) -> list[dict]:
    """One record per member: curves, final validation loss, optimizer time (``timings``; a
    partial record, written before the end, has none)."""
    records = []
    for i, (cfg, opts) in enumerate(zip(cfgs, optimizers)):
        final = curves[i][-1][1] if live[i] else float("nan")
        record = {
            **cfg,
            "label": label(cfg),
            "steps": trained[i],
            "tokens": trained[i] * args.batch * args.seq,
            "train_loss": train_loss_means(losses[:, i]),
            "train_loss_every": TRAIN_LOSS_EVERY,
            "first_train_loss": round(losses[0, i].item(), 4) if len(losses) else math.nan,
            "val_loss": curves[i],
            "final_val_loss": final,
            "diverged": not live[i] or not math.isfinite(final),
            "opt_ms": timings[i][0] if timings else math.nan,
            "opt_ms_p90": timings[i][1] if timings else math.nan,
            "opt_timing": "alone",
            "pack": len(cfgs),
            "pack_wall_s": round(wall, 1),
            "forward_backward_ms": args.forward_backward_ms,
            "compiled": args.compile,
        }
        if timings is None:
            record["partial"] = True
        dion = [o for o in opts if isinstance(o, Dion3)]
        if dion and cfg["f"] == "auto":
            record["auto_fractions"] = resolved_fractions(dion[0], models[i])
        records.append(record)
    return records


def measure_forward_backward(args, corpus: corpus_lib.Corpus) -> float:
    """Median ms of one model's forward, backward and clipping, alone (the single-run step time
    is this plus the optimizer's)."""
    device = torch.device(args.device)
    cfg = parse_config("adamw")
    model = member(cfg, args, device)
    train = corpus.train.to(device)
    starts = corpus_lib.lane_starts(len(corpus.train), args.batch, args.seq, args.timing_steps, 0).to(device)
    times = []
    for step in range(args.timing_steps):
        x, y = windows(train, starts[step], args.seq)
        t = time.perf_counter()
        pack_loss([model], x[None], y[None], args.bf16, args.compile).sum().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
        model.zero_grad(set_to_none=True)
    return statistics.median(times[args.timing_warmup :] or times)


def resolved_fractions(opt: Dion3, model: GPT) -> dict:
    """What fraction="auto" chose, per block-matrix shape ("rows x cols": sorted set of f)."""
    chosen = opt.fractions
    out: dict[str, set] = {}
    for name, p in model.named_parameters():
        if p in chosen:
            out.setdefault("x".join(map(str, p.shape)), set()).add(float(chosen[p]))
    return {shape: sorted(fs) for shape, fs in out.items()}


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


# ------------------------------------------------------------------------------------------------
# Scheduling: packs of ready configs; the lr grid extended to an interior best; more seeds.


def ok(run: dict) -> bool:
    return not run.get("partial") and not run.get("diverged") and "error" not in run and math.isfinite(run.get("final_val_loss", math.nan))


def lr_table(runs: list[dict], fam: str) -> dict[float, list[float]]:
    """lr -> final validation losses (one per seed) of a family's finished runs; a diverged run
    counts as +inf at its lr."""
    table: dict[float, list[float]] = {}
    for r in runs:
        if r["family"] == fam and r["lr"] != "best" and "error" not in r and not r.get("partial"):
            table.setdefault(r["lr"], []).append(r["final_val_loss"] if ok(r) else math.inf)
    return table


def best_lr(runs: list[dict], fam: str) -> tuple[float, bool] | None:
    """(best lr by the mean over seeds, whether it is at an edge of the lrs tried)."""
    table = lr_table(runs, fam)
    if not table:
        return None
    best = min(table, key=lambda lr: statistics.fmean(table[lr]))
    if not math.isfinite(statistics.fmean(table[best])):
        return None
    return best, len(table) == 1 or best in (min(table), max(table))


class Scheduler:
    """Hands out packs of ready configs in list order. lr=best waits for its reference family; with
    ``extend`` a family whose best lr is at an edge gets the next lr beyond it, and with ``seeds``
    a family with an interior best gets that lr again with the other seeds."""

    def __init__(self, configs: list[dict], args, earlier: list[dict]) -> None:
        self.args = args
        self.done = list(earlier)
        self.pending: list[dict] = []
        for cfg in configs:  # what an earlier result holds, or the list names twice, runs once
            if not self._known(cfg):
                self.pending.append(cfg)
        self.families = list(dict.fromkeys(c["family"] for c in configs if c["lr"] != "best"))
        self.start = time.perf_counter()
        self.pack_seconds: list[float] = []

    def _known(self, cfg: dict) -> bool:
        return any(r["name"] == cfg["name"] for r in self.done) or any(c["name"] == cfg["name"] for c in self.pending)

    def _ref_family(self) -> str:
        return parse_config(self.args.best_ref)["family"]

    def _resolve(self, cfg: dict) -> dict | None:
        """lr=best -> the reference family's best lr (None: its lr grid is not settled yet; more
        seeds of it do not hold this up)."""
        if cfg["lr"] != "best":
            return cfg
        ref = self._ref_family()
        if any(c["family"] == ref and c["lr"] != "best" and c["seed"] == 0 for c in self.pending):
            return None
        found = best_lr(self.done, ref)
        if found is None:
            return None
        return named(dict(cfg, lr=found[0], lr_from=ref))

    def _grow(self) -> None:
        for fam in self.families:
            if any(c["family"] == fam for c in self.pending):
                continue
            found = best_lr(self.done, fam)
            if found is None:
                continue
            lr, at_edge = found
            template = next(r for r in self.done if r["family"] == fam)
            tried = sorted(lr_table(self.done, fam))
            if at_edge and self.args.extend and len(tried) < self.args.max_lrs:
                if len(tried) == 1 or lr == max(tried):
                    self._add(template, lr * 2, 0)
                if len(tried) == 1 or lr == min(tried):
                    self._add(template, lr / 2, 0)
            elif not at_edge:
                for seed in range(1, self.args.seeds):
                    self._add(template, lr, seed)

    def _add(self, template: dict, lr: float, seed: int) -> None:
        cfg = named({k: template[k] for k in ("opt", "f", "wd", "options")} | {"lr": float(f"{lr:.6g}"), "seed": seed})
        if not self._known(cfg):
            self.pending.append(cfg)

    def _out_of_time(self) -> bool:
        if not self.args.deadline_s:
            return False
        estimate = (statistics.median(self.pack_seconds) if self.pack_seconds else 0) + 10
        return time.perf_counter() - self.start + estimate > self.args.deadline_s

    def next_pack(self) -> list[dict]:
        self._grow()
        if self._out_of_time():
            if self.pending:
                print(f"deadline: not run: {[c['name'] for c in self.pending]}", file=sys.stderr)
            self.pending.clear()
            return []
        pack = []
        for cfg in list(self.pending):
            resolved = self._resolve(cfg)
            if resolved is None:
                continue
            self.pending.remove(cfg)
            if self._known(resolved) or any(p["name"] == resolved["name"] for p in pack):
                continue
            pack.append(resolved)
            if len(pack) == self.args.pack:
                break
        if not pack and self.pending:
            print(f"not runnable (no reference runs): {[c['name'] for c in self.pending]}", file=sys.stderr)
            self.pending.clear()
        return pack

    def finish(self, records: list[dict], seconds: float) -> None:
        self.done.extend(records)
        self.pack_seconds.append(seconds)


# ------------------------------------------------------------------------------------------------
# Reporting.


def family_summary(runs: list[dict], device: Optional[str] = None) -> dict[str, dict]:
    """Per family: its best lr, the runs there (all seeds), their mean final loss and timings (with
    ``device``, of the runs on it alone: times of two GPUs do not mix)."""
    out = {}
    for fam in dict.fromkeys(r["family"] for r in runs):
        found = best_lr(runs, fam)
        if found is None:
            continue
        lr, edge = found
        at_best = [r for r in runs if r["family"] == fam and r["lr"] == lr and ok(r)]
        # Optimizer times measured alone only (records before that timed steps inside the pack).
        timed = [
            r
            for r in runs
            if r["family"] == fam and ok(r) and r.get("opt_timing") == "alone" and (device is None or r.get("device", device) == device)
        ]
        out[fam] = {
            "label": at_best[0]["label"],
            "lr": lr,
            "edge": edge,
            "lrs": len(lr_table(runs, fam)),
            "finals": [r["final_val_loss"] for r in sorted(at_best, key=lambda r: r["seed"])],
            "final": statistics.fmean(r["final_val_loss"] for r in at_best),
            "opt_ms": statistics.median(r["opt_ms"] for r in timed) if timed else math.nan,
            "runs": at_best,
            "step_ms": statistics.median(r["forward_backward_ms"] + r["opt_ms"] for r in timed) if timed else math.nan,
        }
    return out


def sort_key(fam: str) -> tuple:
    order = {"dion3": 0, "normuon": 1, "muon": 2, "adamw": 3}
    opt = fam.split(":")[0]
    f = fam.split(":")[1][2:] if opt == "dion3" else "1"
    return (order[opt], -(float(f) if f != "auto" else 0), fam)


def format_tables(result: dict) -> str:
    runs, meta = result["runs"], result["meta"]
    summary = family_summary(runs, meta["device"])
    muon = summary.get("muon")
    lines = [
        f"{meta['params'] / 1e6:.2f}M params ({meta['matrix_params'] / 1e6:.2f}M in block matrices), "
        f"{meta['tokens_per_run'] / 1e6:.1f}M tokens per run ({meta['tokens_per_run'] / meta['params']:.1f} per "
        f"parameter), corpus {meta['corpus_bytes']:,} bytes sha256 {meta['corpus_sha256'][:16]}",
        "best lr per family (* at an edge of the lrs tried); final = mean over the seeds at that lr; "
        f"opt ms: median over the family's runs on the {meta['device']} of one optimizer step timed alone (-: none "
        "timed so); step ms: "
        "one model alone (its forward+backward+clip, measured once per invocation, + opt ms)",
        f"{'family':<58}{'lr':>9} {'final':>8}{'vs Muon':>9}  {'seeds':<17}{'opt ms':>8}{'step ms':>9}{'opt vs Muon':>12}{'lrs':>5}",
    ]
    for fam in sorted(summary, key=sort_key):
        s = summary[fam]
        vs = f"{s['final'] - muon['final']:+.4f}" if muon else ""
        ratio = f"{muon['opt_ms'] / s['opt_ms']:.2f}x" if muon and s["opt_ms"] > 0 and math.isfinite(muon["opt_ms"]) else "-"
        step = f"{s['step_ms']:.1f}" if math.isfinite(s["step_ms"]) else "-"
        opt = f"{s['opt_ms']:.2f}" if math.isfinite(s["opt_ms"]) else "-"
        seeds = "/".join(f"{v:.4f}" for v in s["finals"])
        lines.append(
            f"{s['label'][:57]:<58}{s['lr']:>8g}{'*' if s['edge'] else ' '} {s['final']:>8.4f}{vs:>9}  "
            f"{seeds:<17}{opt:>8}{step:>9}{ratio:>12}{s['lrs']:>5}"
        )
    lines += ["", "lr sweep (final validation loss, mean over seeds; x: diverged):"]
    for fam in sorted(summary, key=sort_key):
        table = lr_table(runs, fam)
        cells = [
            f"{lr:g}: "
            + ("x" if not math.isfinite(statistics.fmean(v)) else f"{statistics.fmean(v):.4f}")
            + (f" ({len(v)} seeds)" if len(v) > 1 else "")
            for lr, v in sorted(table.items())
        ]
        lines.append(f"  {summary[fam]['label'][:60]:<62}" + ", ".join(cells))
    lines += [""] + verdicts(summary)
    return "\n".join(line for line in lines if line is not None)


def _verdict(met: bool, best: dict, muon: dict) -> str:
    """The comparisons are on means of two seeds: fewer make a verdict provisional."""
    seeds = min(len(best["finals"]), len(muon["finals"]))
    return ("yes" if met else "no") + ("" if seeds >= 2 else f" (provisional: {seeds} seed)")


def verdicts(summary: dict[str, dict]) -> list[str]:
    muon = summary.get("muon")
    if not muon:
        return ["no Muon run: nothing compared with Muon"]
    out = []
    for f, allowed in MARGINS.items():
        fams = [s for fam, s in summary.items() if fam.startswith(f"dion3:f={f}")]
        if not fams:
            continue
        best = min(fams, key=lambda s: s["final"])
        gap = best["final"] - muon["final"]
        speed = muon["opt_ms"] / best["opt_ms"]
        out.append(
            f"f={fraction_text(f)} within {allowed} of Muon: {_verdict(gap <= allowed, best, muon)} "
            f"({best['label']}: {best['final']:.4f} vs {muon['final']:.4f}, {gap:+.4f}; seeds "
            f"{len(best['finals'])}/{len(muon['finals'])}; optimizer "
            + (f"{speed:.2f}x less time than Muon's)" if math.isfinite(speed) else "time not measured alone)")
        )
    autos = [s for fam, s in summary.items() if fam.startswith("dion3:f=auto")]
    if autos:
        best = min(autos, key=lambda s: s["final"])
        gap = best["final"] - muon["final"]
        out.append(f"auto at or below Muon: {_verdict(gap <= 0, best, muon)} ({best['label']}: {best['final']:.4f}, {gap:+.4f})")
    return out


def plot(result: dict, png: str, families: list[str] | None = None) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print("matplotlib not importable: no plot (use --plot-only JSON later)", file=sys.stderr)
        return False
    meta = result["meta"]
    summary = family_summary(result["runs"], meta["device"])
    fams = [f for f in sorted(summary, key=sort_key) if not families or f in families]
    tokens_per_step = meta["tokens_per_step"]
    fig, axes = plt.subplots(1, 3, figsize=(19, 5.6))
    colors = plt.get_cmap("tab20").colors
    finals, lrs = [], set()
    for n, fam in enumerate(fams):
        s = summary[fam]
        curves = [r["val_loss"] for r in s["runs"]]
        steps = [p[0] for p in curves[0]]
        mean = [statistics.fmean(c[j][1] for c in curves) for j in range(len(steps))]
        style = dict(
            color=colors[n % 20], marker="o", ms=2.5, lw=1.4, ls="--" if fam.split(":")[0] in ("muon", "adamw", "normuon") else "-"
        )
        lab = f"{s['label']}, lr {s['lr']:g} ({len(curves)} seed{'s' if len(curves) > 1 else ''}): {s['final']:.3f}"
        axes[0].plot([st * tokens_per_step / 1e6 for st in steps], mean, label=lab, **style)
        if math.isfinite(s["step_ms"]):
            axes[1].plot([st * s["step_ms"] / 1e3 for st in steps], mean, **style)
        finals.append(s["final"])
        table = lr_table(result["runs"], fam)
        if len(table) > 1:
            pts = [(lr, statistics.fmean(v)) for lr, v in sorted(table.items()) if math.isfinite(statistics.fmean(v))]
            axes[2].plot(*zip(*pts), color=colors[n % 20], marker="o", ls=style["ls"])
            lrs.update(lr for lr, _ in pts)
    if finals:
        lo, hi = min(finals), max(finals)
        for ax in axes:
            ax.set_ylim(lo - 0.03, max(hi + 0.15, lo + 0.3))
            ax.grid(alpha=0.3)
    axes[0].set(
        title="validation loss vs tokens (best lr each; mean over seeds)", xlabel="tokens (M)", ylabel="validation loss (nats/byte)"
    )
    axes[1].set(title="validation loss vs time (one model alone: fwd+bwd+clip + its optimizer)", xlabel="seconds")
    if not axes[1].lines:
        axes[1].text(0.5, 0.5, "no optimizer timed alone yet", ha="center", transform=axes[1].transAxes)
    axes[2].set(title="lr sweep: final validation loss", xlabel="lr", xscale="log")
    axes[2].xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axes[2].set_xticks(sorted(lrs), [f"{lr:g}" for lr in sorted(lrs)], rotation=45, fontsize=8)
    axes[0].legend(fontsize=7, loc="upper right")
    fig.suptitle(
        f"{meta['params'] / 1e6:.1f}M-parameter byte GPT, {meta['tokens_per_run'] / 1e6:.0f}M tokens per run "
        f"({meta['tokens_per_run'] / meta['params']:.1f} per parameter), {meta['device']}, torch {meta['torch']}"
    )
    fig.tight_layout()
    # A 64-colour palette keeps a plot near 60 KB (~200 KB as RGBA): the tracked tree must stay small
    # enough to travel to the GPU machine beside the CuTe DSL archive.
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    from PIL import Image  # a dependency of matplotlib

    Image.open(buf).convert("RGB").quantize(colors=64, method=Image.Quantize.MEDIANCUT).save(png, optimize=True)
    return True


MERGE_KEYS = ("training", "corpus_sha256", "params")


def load_results(paths: list[str]) -> dict | None:
    """Several results of the same training settings and corpus as one (runs deduplicated by name)."""
    merged = None
    for path in paths:
        with open(path) as fh:
            result = json.load(fh)
        result["runs"] = [r for r in result["runs"] if not r.get("partial")]  # a killed pack's curves so far
        for r in result["runs"]:  # records written before they carried their invocation's timing and device
            r.setdefault("forward_backward_ms", result["meta"].get("forward_backward_ms", math.nan))
            r.setdefault("device", result["meta"].get("device"))
        if merged is None:
            merged = result
            merged["meta"]["commands"] = list(result["meta"].get("commands", [result["meta"]["command"]]))
            continue
        diff = [k for k in MERGE_KEYS if result["meta"].get(k) != merged["meta"].get(k)]
        if diff:
            raise SystemExit(f"{path}: differs from {paths[0]} in {diff}: not merged")
        merged["meta"]["commands"] += result["meta"].get("commands", [result["meta"]["command"]])
        names = {r["name"] for r in merged["runs"]}
        merged["runs"] += [r for r in result["runs"] if r["name"] not in names]
    return merged


def write_json(result: dict, path: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:  # one line per run: the curves are long, the file travels with the repo
        runs = ",\n".join(json.dumps(r, separators=(",", ":")) for r in result["runs"])
        fh.write(f'{{"meta": {json.dumps(result["meta"], indent=1)},\n"runs": [\n{runs}\n]}}\n')
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="*", default=[], help="opt[:key=value]... (see the module docstring)")
    p.add_argument("--extend", action="store_true", help="extend each family's lr grid (2x) until its best is interior")
    p.add_argument("--max-lrs", type=int, default=6, help="at most this many lrs per family with --extend")
    p.add_argument("--seeds", type=int, default=1, help="run each family's interior best lr with this many seeds")
    p.add_argument("--best-ref", default="dion3:f=0.25", help="the family whose best lr lr=best takes")
    p.add_argument("--pack", type=int, default=8, help="models trained side by side")
    p.add_argument("--merge", nargs="*", default=[], metavar="JSON", help="earlier results of the same settings")
    p.add_argument("--json", default=None, help="results (default convergence.json; with --plot-only: the merge)")
    p.add_argument("--png", default=None)
    p.add_argument("--plot-only", nargs="+", default=None, metavar="JSON", help="tables and plot of finished runs")
    p.add_argument("--plot-families", nargs="*", default=None, help="only these families in the plot")
    p.add_argument("--deadline-s", type=float, default=0, help="start no pack that would end after this many seconds")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    for key in ("layers", "hidden", "heads", "ffn", "seq", "batch"):
        p.add_argument(f"--{key}", type=int, default=None, help=f"overrides --size's {key}")
    p.add_argument("--steps", type=int, default=None, help="default: --tokens-per-param tokens per parameter")
    p.add_argument("--tokens-per-param", type=float, default=10.0)
    p.add_argument("--max-corpus-bytes", type=int, default=None, help="read at most this much (tests)")
    corpus = p.add_mutually_exclusive_group()
    corpus.add_argument("--corpus-root", nargs="*", default=None, help="read these folders instead of the installation's")
    corpus.add_argument(
        "--stdlib-only",
        action="store_true",
        help="read the standard library only: a corpus that "
        "installing packages does not change (the proxy's; enough for --size proxy, not for small)",
    )
    p.add_argument("--seed", type=int, default=0, help="base seed of the initial weights")
    p.add_argument("--aux-lr", type=float, default=3e-3, help="AdamW lr of embedding, head and norms (every run)")
    p.add_argument("--aux-wd", type=float, default=0.0)
    p.add_argument("--warmup-frac", type=float, default=0.05)
    p.add_argument("--final-lr-frac", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--no-bf16", dest="bf16", action="store_false")
    p.add_argument("--compile", action="store_true", help="torch.compile the model's loss (same math; the norms, RoPE and SwiGLU fused)")
    p.add_argument("--eval-every", type=int, default=0, help="0: steps / 10")
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--timing-warmup", type=int, default=10)
    p.add_argument("--timing-steps", type=int, default=30, help="steps of the one-model forward/backward timing")
    p.add_argument("--profile", action="store_true", help="print the kernels of the one-model timing steps")
    return p


TRAINING_KEYS = (
    "layers",
    "hidden",
    "heads",
    "ffn",
    "seq",
    "batch",
    "steps",
    "seed",
    "aux_lr",
    "aux_wd",
    "warmup_frac",
    "final_lr_frac",
    "clip",
    "bf16",
    "eval_every",
    "eval_batches",
)


def resolve_size(args) -> None:
    for key, value in SIZES[args.size].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.steps is None:
        params = sum(p.numel() for p in GPT(**model_config(args)).parameters())
        args.steps = math.ceil(args.tokens_per_param * params / (args.batch * args.seq))


def main(argv: list[str] | None = None) -> dict | None:
    args = parser().parse_args(argv)
    if args.plot_only:
        result = load_results(args.plot_only)
        if args.json:
            write_json(result, args.json)
        print(format_tables(result))
        if args.png:
            plot(result, args.png, args.plot_families)
        return result
    configs = [parse_config(t) for t in args.configs]
    if args.compile:
        torch._dynamo.config.cache_size_limit = 64  # one graph per pack size and input layout
    if not configs:
        raise SystemExit("nothing to run: give --configs")
    resolve_size(args)
    need = args.steps * args.batch * args.seq + args.batch
    t = time.perf_counter()
    roots = [Path(r) for r in args.corpus_root] if args.corpus_root else corpus_lib.source_roots(args.stdlib_only)
    corpus = corpus_lib.build(min_bytes=need, roots=roots, max_bytes=args.max_corpus_bytes)
    corpus_lib.val_starts(len(corpus.val), args.seq, args.eval_batches * args.batch)  # a usable held-out split
    model = GPT(**model_config(args))
    matrices, others = split_params(model)
    n_params = sum(p.numel() for p in model.parameters())
    device = torch.device(args.device)
    meta = {
        "date": datetime.date.today().isoformat(),
        "command": "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "device": device_name(device),
        "params": n_params,
        "matrix_params": sum(p.numel() for p in matrices),
        "other_params": sum(p.numel() for p in others),
        "size": args.size,
        "tokens_per_step": args.batch * args.seq,
        "tokens_per_run": args.steps * args.batch * args.seq,
        "corpus_bytes": corpus.bytes,
        "corpus_files": corpus.files,
        "corpus_sha256": corpus.sha256,
        "train_bytes": len(corpus.train),
        "val_bytes": len(corpus.val),
        "val_tokens": args.eval_batches * args.batch * args.seq,
        "training": {k: getattr(args, k) for k in TRAINING_KEYS},
    }
    print(
        f"corpus: {corpus.bytes:,} bytes in {corpus.files} files ({time.perf_counter() - t:.0f} s), sha256 "
        f"{corpus.sha256[:16]}; {n_params / 1e6:.2f}M params, {meta['tokens_per_run'] / 1e6:.1f}M tokens per run "
        f"({args.steps} steps)",
        flush=True,
    )
    earlier = load_results(args.merge) if args.merge else None
    if earlier:
        diff = [k for k in MERGE_KEYS if earlier["meta"].get(k) != meta.get(k)]
        if diff:
            raise SystemExit(f"--merge: the earlier results differ from this run in {diff}")
    result = {"meta": meta, "runs": list(earlier["runs"]) if earlier else []}
    meta["commands"] = (earlier["meta"]["commands"] if earlier else []) + [meta["command"]]
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            measure_forward_backward(args, corpus)
        print(
            prof.key_averages().table(
                sort_by="self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total", row_limit=25, max_name_column_width=60
            )
        )
    meta["forward_backward_ms"] = args.forward_backward_ms = measure_forward_backward(args, corpus)
    print(f"one model's forward+backward+clip: {args.forward_backward_ms:.2f} ms", flush=True)
    path = args.json or "convergence.json"
    sched = Scheduler(configs, args, result["runs"])
    while pack := sched.next_pack():
        t = time.perf_counter()

        def partial(records: list[dict]) -> None:
            result["runs"] = sched.done + records
            write_json(result, path)

        try:
            records = run_pack(pack, args, corpus, on_eval=partial)
        except Exception:
            error = traceback.format_exc()
            print(error, file=sys.stderr)
            records = [{**c, "label": label(c), "error": error, "diverged": True} for c in pack]
        sched.finish(records, time.perf_counter() - t)
        result["runs"] = sched.done
        write_json(result, path)
    print(format_tables(result))
    if args.png:
        plot(result, args.png, args.plot_families)
    return result


if __name__ == "__main__":
    main()
