"""Convergence benchmark: a ~100M-parameter byte-level GPT, the same tokens and init for every optimizer.

Plain PyTorch (torch + numpy only): pre-norm RMSNorm, RoPE, SwiGLU MLP, causal
``F.scaled_dot_product_attention``, untied embedding and head, bf16 autocast over fp32 weights.
Data: the running Python's standard-library sources (``dion3_megatron.corpus.stdlib_bytes``) as
bytes (vocab 256); the last 5% is held out. Every run sees the same batch sequence (windows drawn
once from a fixed seed) and starts from the same weights (same seed).

The optimizers differ only on the matrices of the transformer blocks (Q, K, V, O, gate, up,
down); the embedding, the head and the norm gains take the same AdamW settings in every run:

  dion3     dion3_megatron.Dion3 (Gram NS, scale_lr_by_fraction=True), f = fraction or "auto";
            the other parameters in a Dion3 param group with algorithm="adamw"
  normuon   the Dion3 rule at f = 1 with standard NS: NorMuon with heavy-ball momentum
  muon      torch.optim.Muon (Nesterov, EMA momentum 0.95, its default adjust_lr) + torch AdamW
  adamw     torch.optim.AdamW: matrices at the swept lr, the rest at the common AdamW settings

A config is ``opt[:key=value]...``, keys f (a fraction or "auto"), lr (a number, or "best": the best
lr among the finished runs of ``--best-ref``, by default dion3 at f = 0.25, in the same
invocation), wd, mu (dion3/normuon momentum, default 0.95), mu_by_f=1 (dion3's
scale_mu_by_fraction: the applied rows decay by mu ** (1/f)), and aux=torch (dion3/normuon: torch
AdamW instead of Dion3's adamw group for the non-matrix parameters; a timing diagnostic). Examples:

  python benchmarks/bench_convergence.py --configs dion3:f=0.25:lr=0.02 muon:lr=0.025 adamw:lr=0.002
  python benchmarks/bench_convergence.py --sweep --gpus 2 --json out.json --png out.png
  python benchmarks/bench_convergence.py --plot-only out.json [more.json ...] [--json merged.json] --png out.png

``--gpus N`` starts one worker process per GPU (CUDA_VISIBLE_DEVICES=i) that takes the next ready
config from a shared queue; results are merged into one JSON, rewritten after every run (so a
killed job keeps what finished). Timing: CUDA events around each step (data, forward, backward,
clip, optimizer) and around the optimizer's ``step()`` calls; medians over the steps after
``--timing-warmup``; no host synchronization is added inside a step.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from dion3_megatron import Dion3  # noqa: E402
from dion3_megatron.corpus import stdlib_bytes  # noqa: E402

OPTIMIZERS = ("dion3", "normuon", "muon", "adamw")
LABELS = {
    "dion3": "Dion3 f={f}",
    "normuon": "NorMuon (Dion3 f=1, std NS)",
    "muon": "Muon (torch.optim.Muon)",
    "adamw": "AdamW",
}
DEFAULT_WD = {"dion3": 0.01, "normuon": 0.01, "muon": 0.01, "adamw": 0.1}
DEFAULT_MU = 0.95  # dion3 / normuon momentum (error-feedback decay of the applied rows)
SWEEP_LRS = {
    "dion3": (0.01, 0.02, 0.04),
    "normuon": (0.01, 0.02, 0.04),
    "muon": (0.0125, 0.025, 0.05),
    "adamw": (0.0015, 0.003, 0.006),
}
SWEEP_FRACTIONS = (0.25, 0.5, 0.125)
RESULT_TAG = "@@RESULT "


# ------------------------------------------------------------------------------------------------
# Configs.


def fraction_text(f) -> str:
    if f == "auto":
        return "auto"
    inv = 1 / f
    return f"1/{round(inv)}" if abs(inv - round(inv)) < 1e-9 and f < 1 else f"{f:g}"


def parse_config(text: str) -> dict:
    """``dion3:f=0.25:lr=0.02`` -> {"opt": "dion3", "f": 0.25, "lr": 0.02, "wd": 0.01, "name": ...}."""
    parts = text.strip().split(":")
    opt = parts[0]
    if opt not in OPTIMIZERS:
        raise ValueError(f"config {text!r}: optimizer must be one of {OPTIMIZERS}")
    cfg: dict = {"opt": opt, "f": None, "lr": None, "wd": DEFAULT_WD[opt], "aux": "dion3", "mu": DEFAULT_MU, "mu_by_f": False}
    for part in parts[1:]:
        key, sep, value = part.partition("=")
        if not sep or key not in ("f", "lr", "wd", "aux", "mu", "mu_by_f"):
            raise ValueError(f"config {text!r}: expected key=value with key f, lr, wd, mu, mu_by_f or aux, got {part!r}")
        if key == "aux":
            if opt not in ("dion3", "normuon") or value not in ("dion3", "torch"):
                raise ValueError(f"config {text!r}: aux (dion3 or torch) is for dion3 and normuon only")
            cfg["aux"] = value
        elif key == "f":
            if opt != "dion3":
                raise ValueError(f"config {text!r}: only dion3 takes f")
            cfg["f"] = "auto" if value == "auto" else float(value)
            if cfg["f"] != "auto" and not 0 < cfg["f"] <= 1:
                raise ValueError(f"config {text!r}: f must be in (0, 1] or auto")
        elif key == "mu_by_f":
            if opt != "dion3" or value not in ("0", "1"):
                raise ValueError(f"config {text!r}: mu_by_f (0 or 1) is for dion3 only")
            cfg["mu_by_f"] = value == "1"
        elif key == "mu":
            if opt not in ("dion3", "normuon") or not 0 <= float(value) < 1:
                raise ValueError(f"config {text!r}: mu (in [0, 1)) is for dion3 and normuon only")
            cfg["mu"] = float(value)
        elif key == "lr" and value == "best":
            cfg["lr"] = "best"
        else:
            cfg[key] = float(value)
    if opt == "dion3" and cfg["f"] is None:
        cfg["f"] = 0.25
    if opt == "normuon":
        cfg["f"] = 1.0
    if cfg["lr"] is None:
        cfg["lr"] = SWEEP_LRS[opt][1]
    cfg["family"] = family(cfg)
    cfg["name"] = config_name(cfg)
    return cfg


def family(cfg: dict) -> str:
    """The run's optimizer without its lr: what the lr sweep picks a best run for."""
    base = f"dion3:f={cfg['f']}" if cfg["opt"] == "dion3" else cfg["opt"]
    if cfg.get("mu", DEFAULT_MU) != DEFAULT_MU:
        base += f":mu={cfg['mu']:g}"
    if cfg.get("mu_by_f"):
        base += ":mu_by_f=1"
    return base + (":aux=torch" if cfg.get("aux") == "torch" else "")


def config_name(cfg: dict) -> str:
    parts = [cfg["opt"]]
    if cfg["opt"] == "dion3":
        parts.append(f"f={cfg['f']}")
    if cfg.get("mu", DEFAULT_MU) != DEFAULT_MU:
        parts.append(f"mu={cfg['mu']:g}")
    if cfg.get("mu_by_f"):
        parts.append("mu_by_f=1")
    parts.append(f"lr={cfg['lr']:g}" if cfg["lr"] != "best" else "lr=best")
    if cfg["wd"] != DEFAULT_WD[cfg["opt"]]:
        parts.append(f"wd={cfg['wd']:g}")
    if cfg.get("aux") == "torch":
        parts.append("aux=torch")
    return ":".join(parts)


def label(cfg: dict) -> str:
    text = LABELS[cfg["opt"]].format(f=fraction_text(cfg["f"])) if cfg["opt"] == "dion3" else LABELS[cfg["opt"]]
    if cfg.get("mu", DEFAULT_MU) != DEFAULT_MU:
        text += f", mu {cfg['mu']:g}"
    if cfg.get("mu_by_f"):
        text += ", mu^(1/f)"
    return text + (", torch AdamW rest" if cfg.get("aux") == "torch" else "")


def auto_available() -> bool:
    try:
        Dion3([nn.Parameter(torch.randn(8, 8))], fraction="auto")
        return True
    except Exception:
        return False


def sweep_configs(with_auto: bool, with_aux_variant: bool = True) -> list[str]:
    """The sweep, f = 1/4 first (its best lr is what the auto run uses)."""
    out = [f"dion3:f={SWEEP_FRACTIONS[0]}:lr={lr:g}" for lr in SWEEP_LRS["dion3"]]
    if with_auto:
        out.append("dion3:f=auto:lr=best")
    if with_aux_variant:
        out.append(f"dion3:f={SWEEP_FRACTIONS[0]}:lr=best:aux=torch")
    for f in SWEEP_FRACTIONS[1:]:
        out += [f"dion3:f={f}:lr={lr:g}" for lr in SWEEP_LRS["dion3"]]
    for opt in ("normuon", "muon", "adamw"):
        out += [f"{opt}:lr={lr:g}" for lr in SWEEP_LRS[opt]]
    return out


# ------------------------------------------------------------------------------------------------
# Model.


class Block(nn.Module):
    def __init__(self, d: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.RMSNorm(d, eps=1e-6)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.norm2 = nn.RMSNorm(d, eps=1e-6)
        self.gate = nn.Linear(d, ffn, bias=False)
        self.up = nn.Linear(d, ffn, bias=False)
        self.down = nn.Linear(ffn, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.norm1(x)
        q, k, v = (lin(h).view(b, t, self.heads, -1).transpose(1, 2) for lin in (self.q, self.k, self.v))
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, ffn: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads, ffn) for _ in range(layers))
        self.norm = nn.RMSNorm(d, eps=1e-6)
        self.head = nn.Linear(d, vocab, bias=False)
        head_dim = d // heads
        inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("o.weight", "down.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.embed(idx)
        cos, sin = self.cos[:t], self.sin[:t]
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))


def split_params(model: GPT) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(the block matrices, everything else: embedding, head, norm gains)."""
    matrices = [p for n, p in model.named_parameters() if n.startswith("blocks.") and p.dim() == 2]
    ids = {id(p) for p in matrices}
    return matrices, [p for p in model.parameters() if id(p) not in ids]


# ------------------------------------------------------------------------------------------------
# Optimizers.


def build_optimizers(cfg: dict, model: GPT, args) -> list[torch.optim.Optimizer]:
    matrices, others = split_params(model)
    aux = dict(lr=args.aux_lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=args.aux_wd)
    opt, lr, wd = cfg["opt"], cfg["lr"], cfg["wd"]
    if opt in ("dion3", "normuon"):
        dion = dict(lr=lr, fraction=cfg["f"], mu=cfg.get("mu", DEFAULT_MU), scale_mu_by_fraction=cfg.get("mu_by_f", False), beta2=0.95, weight_decay=wd,
                    scale_lr_by_fraction=True, ns_method="gram" if opt == "dion3" else "standard")
        if cfg.get("aux") == "torch":  # diagnostic: the same AdamW math in torch's foreach implementation
            return [Dion3([{"params": matrices}], **dion), torch.optim.AdamW(others, **aux)]
        return [Dion3([{"params": matrices}, {"params": others, "algorithm": "adamw", **aux}], **dion)]
    if opt == "muon":
        return [torch.optim.Muon(matrices, lr=lr, weight_decay=wd, momentum=0.95, nesterov=True),
                torch.optim.AdamW(others, **aux)]
    return [torch.optim.AdamW([{"params": matrices, "lr": lr, "weight_decay": wd}, {"params": others, **aux}],
                              lr=lr, betas=(0.9, 0.95), eps=1e-8)]


def lr_multiplier(step: int, steps: int, warmup: int, final: float) -> float:
    """Linear warmup to 1 over ``warmup`` steps, then cosine to ``final``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - 1 - warmup)
    return final + (1 - final) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


# ------------------------------------------------------------------------------------------------
# Data.

_DATA_CACHE: dict = {}


def load_data(args) -> dict:
    key = (args.max_bytes, args.val_frac)
    if key not in _DATA_CACHE:
        raw = stdlib_bytes(args.max_bytes)
        tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        n_val = max(1, int(len(tokens) * args.val_frac))
        _DATA_CACHE[key] = {
            "train": tokens[:-n_val].clone(), "val": tokens[-n_val:].clone(),
            "bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()[:16],
        }
    return _DATA_CACHE[key]


def batch_offsets(n_train: int, args) -> torch.Tensor:
    """(steps, batch) window starts: the same for every run."""
    gen = torch.Generator().manual_seed(args.data_seed)
    return torch.randint(0, n_train - args.seq - 1, (args.steps, args.batch), generator=gen)


def val_offsets(n_val: int, args) -> torch.Tensor:
    """(eval_batches, batch) evenly spaced held-out window starts."""
    count = args.eval_batches * args.batch
    if n_val < args.seq + 2:
        raise ValueError(f"held-out split of {n_val} bytes is shorter than one window")
    return torch.linspace(0, n_val - args.seq - 1, count).long().view(args.eval_batches, args.batch)


def windows(tokens: torch.Tensor, starts: torch.Tensor, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = tokens[starts.unsqueeze(-1) + torch.arange(seq + 1, device=tokens.device)].long()
    return w[:, :-1], w[:, 1:]


# ------------------------------------------------------------------------------------------------
# One run.


class StepTimer:
    """CUDA events (no added synchronization) on a GPU; perf_counter on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[tuple] = []

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def add(self, start, opt_start, end) -> None:
        self.marks.append((start, opt_start, end))

    def millis(self) -> tuple[list[float], list[float]]:
        if self.cuda:
            torch.cuda.synchronize()
            step = [a.elapsed_time(c) for a, b, c in self.marks]
            opt = [b.elapsed_time(c) for a, b, c in self.marks]
        else:
            step = [(c - a) * 1e3 for a, b, c in self.marks]
            opt = [(c - b) * 1e3 for a, b, c in self.marks]
        return step, opt


@torch.no_grad()
def evaluate(model: GPT, val: torch.Tensor, offsets: torch.Tensor, args, device) -> float:
    model.eval()
    total = torch.zeros((), device=device)
    for starts in offsets:
        x, y = windows(val, starts.to(device), args.seq)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            logits = model(x)
        total += F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))
    model.train()
    return float(total / len(offsets))


def model_config(args) -> dict:
    return dict(vocab=256, d=args.hidden, layers=args.layers, heads=args.heads, ffn=args.ffn, seq=args.seq)


def run_one(cfg: dict, args, log=print) -> dict:
    """Train one config; returns the run's record (curves, final val loss, timings)."""
    device = torch.device(args.device)
    data = load_data(args)
    train, val = data["train"].to(device), data["val"].to(device)
    offsets = batch_offsets(len(data["train"]), args).to(device)
    voffsets = val_offsets(len(data["val"]), args)
    torch.manual_seed(args.seed)
    model = GPT(**model_config(args)).to(device)
    optimizers = build_optimizers(cfg, model, args)
    base_lrs = [[g["lr"] for g in o.param_groups] for o in optimizers]
    params = list(model.parameters())
    warmup = max(1, round(args.warmup_frac * args.steps))
    timer = StepTimer(device)
    losses = torch.zeros(args.steps, device=device)
    val_curve = [[0, evaluate(model, val, voffsets, args, device)]]
    eval_every = args.eval_every or max(1, args.steps // 5)
    diverged, steps_done = False, 0
    t0 = time.perf_counter()
    log(f"{cfg['name']}: start (val {val_curve[0][1]:.4f})")
    for step in range(args.steps):
        mult = lr_multiplier(step, args.steps, warmup, args.final_lr_frac)
        for opt, lrs in zip(optimizers, base_lrs):
            for group, lr in zip(opt.param_groups, lrs):
                group["lr"] = lr * mult
        start = timer.mark()
        x, y = windows(train, offsets[step], args.seq)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, args.clip)
        opt_start = timer.mark()
        for opt in optimizers:
            opt.step()
        timer.add(start, opt_start, timer.mark())
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        losses[step] = loss.detach()
        steps_done = step + 1
        if steps_done % eval_every == 0 or steps_done == args.steps:
            if not bool(torch.isfinite(losses[:steps_done]).all()):
                diverged = True
                log(f"{cfg['name']}: non-finite loss by step {steps_done}, stopped")
                break
            val_curve.append([steps_done, evaluate(model, val, voffsets, args, device)])
            log(f"{cfg['name']}: step {steps_done}/{args.steps} train {float(losses[step]):.4f} "
                f"val {val_curve[-1][1]:.4f} ({time.perf_counter() - t0:.1f} s)")
    wall = time.perf_counter() - t0
    step_ms, opt_ms = timer.millis()
    timed_step = step_ms[args.timing_warmup:] or step_ms
    timed_opt = opt_ms[args.timing_warmup:] or opt_ms
    final = val_curve[-1][1] if not diverged else float("nan")
    record = {
        **cfg, "label": label(cfg),
        "steps": steps_done, "tokens": steps_done * args.batch * args.seq,
        "train_loss": [round(v, 5) for v in losses[:steps_done].tolist()],
        "val_loss": val_curve, "final_val_loss": final, "diverged": diverged or not math.isfinite(final),
        "step_ms": statistics.median(timed_step), "opt_ms": statistics.median(timed_opt),
        "step_ms_p90": sorted(timed_step)[int(0.9 * (len(timed_step) - 1))],
        "wall_s": round(wall, 2), "device": device_name(device),
    }
    record["opt_share"] = record["opt_ms"] / record["step_ms"]
    dion = [o for o in optimizers if isinstance(o, Dion3)]
    if dion and cfg["f"] == "auto":
        record["auto_fractions"] = resolved_fractions(dion[0], model)
    log(f"{cfg['name']}: final val {final:.4f}, step {record['step_ms']:.2f} ms, "
        f"opt {record['opt_ms']:.2f} ms ({100 * record['opt_share']:.1f}%), {wall:.1f} s")
    return record


def resolved_fractions(opt: Dion3, model: GPT) -> dict:
    """What fraction="auto" chose, per block-matrix shape ("rows x cols": sorted set of f)."""
    chosen = getattr(opt, "fractions", None) or {}
    out: dict[str, set] = {}
    for name, p in model.named_parameters():
        if p in chosen:
            out.setdefault("x".join(map(str, p.shape)), set()).add(float(chosen[p]))
    return {shape: sorted(fs) for shape, fs in out.items()}


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


# ------------------------------------------------------------------------------------------------
# Scheduling: one in-process worker, or one worker process per GPU.


class Scheduler:
    """Hands out configs in list order, skipping those not ready yet (lr=best waits for its reference runs)."""

    def __init__(self, configs: list[dict], args) -> None:
        self.pending = list(configs)
        self.running: dict[str, str] = {}
        self.done: list[dict] = []
        self.args = args
        self.cond = threading.Condition()
        self.start = time.perf_counter()

    def _ref_family(self, cfg: dict) -> str:
        return parse_config(self.args.best_ref)["family"] if cfg["opt"] == "dion3" else cfg["family"]

    def _ready(self, cfg: dict) -> bool:
        """lr=best waits until no run of its reference family is pending or running."""
        if cfg["lr"] != "best":
            return True
        ref = self._ref_family(cfg)
        return not any(c["family"] == ref and c["lr"] != "best" for c in self.pending) and ref not in self.running.values()

    def _resolve(self, cfg: dict) -> dict | None:
        if cfg["lr"] != "best":
            return cfg
        ref = self._ref_family(cfg)
        finished = [r for r in self.done if r.get("family") == ref and not r.get("diverged") and "error" not in r]
        if not finished:
            print(f"skipping {cfg['name']}: no finished {ref} run to take the best lr from", file=sys.stderr)
            return None
        best = min(finished, key=lambda r: r["final_val_loss"])
        resolved = dict(cfg, lr=best["lr"], lr_from=best["name"])
        resolved["name"] = config_name(resolved)
        return resolved

    def _out_of_time(self) -> bool:
        if not self.args.deadline_s:
            return False
        walls = [r["wall_s"] for r in self.done if "wall_s" in r]
        estimate = (statistics.median(walls) if walls else 0) + 15
        return time.perf_counter() - self.start + estimate > self.args.deadline_s

    def next(self) -> dict | None:
        with self.cond:
            while self.pending:
                if self._out_of_time():
                    print(f"deadline: {len(self.pending)} config(s) not run: "
                          f"{[c['name'] for c in self.pending]}", file=sys.stderr)
                    self.pending.clear()
                    break
                for cfg in self.pending:
                    if self._ready(cfg):
                        self.pending.remove(cfg)
                        cfg = self._resolve(cfg)
                        if cfg is None:
                            break
                        self.running[cfg["name"]] = cfg["family"]
                        return cfg
                else:
                    self.cond.wait()
            self.cond.notify_all()
            return None

    def finish(self, cfg: dict, record: dict) -> None:
        with self.cond:
            self.running.pop(cfg["name"], None)
            self.done.append(record)
            self.cond.notify_all()


def training_args(args) -> dict:
    keys = ("device", "layers", "hidden", "heads", "ffn", "seq", "batch", "steps", "max_bytes", "val_frac",
            "seed", "data_seed", "aux_lr", "aux_wd", "warmup_frac", "final_lr_frac", "clip", "bf16",
            "eval_every", "eval_batches", "timing_warmup")
    return {k: getattr(args, k) for k in keys}


def run_all(configs: list[dict], args, on_record) -> list[dict]:
    sched = Scheduler(configs, args)
    workers = max(1, args.gpus)

    def finish(cfg, record):
        sched.finish(cfg, record)
        on_record(sched.done)

    if workers == 1:
        while (cfg := sched.next()) is not None:
            try:
                record = run_one(cfg, args)
            except Exception:
                record = {**cfg, "label": label(cfg), "error": traceback.format_exc(), "diverged": True}
                print(record["error"], file=sys.stderr)
            finish(cfg, record)
        return sched.done

    def worker(index: int) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if torch.cuda.is_available():
            env["CUDA_VISIBLE_DEVICES"] = str(index)
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", str(index),
                                 "--gpus", str(workers)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True, bufsize=1)
        try:
            while (cfg := sched.next()) is not None:
                proc.stdin.write(json.dumps({"cfg": cfg, "args": training_args(args)}) + "\n")
                proc.stdin.flush()
                record = None
                for line in proc.stdout:
                    if line.startswith(RESULT_TAG):
                        record = json.loads(line[len(RESULT_TAG):])
                        break
                    sys.stdout.write(line)
                if record is None:
                    record = {**cfg, "label": label(cfg), "error": f"worker {index} exited", "diverged": True}
                    finish(cfg, record)
                    return
                record["worker"] = index
                finish(cfg, record)
        finally:
            if proc.stdin and not proc.stdin.closed:
                proc.stdin.close()
            proc.wait()

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sched.done


def worker_main(index: int, workers: int) -> None:
    """Read one JSON job per stdin line, answer one RESULT line per job."""
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
    for line in sys.stdin:
        job = json.loads(line)
        args = argparse.Namespace(**job["args"])
        cfg = job["cfg"]
        try:
            record = run_one(cfg, args, log=lambda msg: print(f"[worker {index}] {msg}", flush=True))
        except Exception:
            record = {**cfg, "label": label(cfg), "error": traceback.format_exc(), "diverged": True}
            print(record["error"], flush=True)
        print(RESULT_TAG + json.dumps(record), flush=True)


# ------------------------------------------------------------------------------------------------
# Reporting.


def best_per_family(runs: list[dict]) -> dict[str, dict]:
    best: dict[str, dict] = {}
    for r in runs:
        if r.get("diverged") or "error" in r or not math.isfinite(r.get("final_val_loss", float("nan"))):
            continue
        if r["family"] not in best or r["final_val_loss"] < best[r["family"]]["final_val_loss"]:
            best[r["family"]] = r
    return best


def family_order(fam: str) -> tuple:
    order = {"dion3:f=0.5": 0, "dion3:f=0.25": 1, "dion3:f=0.125": 2, "dion3:f=auto": 3,
             "dion3:f=0.25:aux=torch": 4, "normuon": 5, "muon": 6, "adamw": 7}
    return (order.get(fam, 9), fam)


def verdicts(runs: list[dict]) -> list[str]:
    best = best_per_family(runs)
    out = []
    d, m, a = best.get("dion3:f=0.25"), best.get("muon"), best.get("adamw")
    if d and m and a:
        ok = d["final_val_loss"] <= m["final_val_loss"] and d["final_val_loss"] < a["final_val_loss"]
        out.append(f"target (Dion3 f=1/4 val <= Muon's and < AdamW's): {'MET' if ok else 'MISSED'} "
                   f"(Dion3 f=1/4 {d['final_val_loss']:.4f}, Muon {m['final_val_loss']:.4f} "
                   f"[{d['final_val_loss'] - m['final_val_loss']:+.4f}], AdamW {a['final_val_loss']:.4f} "
                   f"[{d['final_val_loss'] - a['final_val_loss']:+.4f}])")
    auto = best.get("dion3:f=auto")
    fixed = [best[k] for k in ("dion3:f=0.5", "dion3:f=0.25", "dion3:f=0.125") if k in best]
    if auto and fixed:
        def median_step(fam: str) -> float:  # one run's step time is noisy: the median over the family's runs
            return statistics.median(r["step_ms"] for r in runs if r["family"] == fam and "error" not in r
                                     and not r.get("diverged"))

        auto_ms = median_step(auto["family"])
        for what, ref in (("best-loss", min(fixed, key=lambda r: r["final_val_loss"])),
                          ("fastest", min(fixed, key=lambda r: median_step(r["family"])))):
            ref_ms = median_step(ref["family"])
            out.append(f"auto vs the {what} fixed f ({ref['label']}): val {auto['final_val_loss']:.4f} vs "
                       f"{ref['final_val_loss']:.4f} ({auto['final_val_loss'] - ref['final_val_loss']:+.4f}); step ms "
                       f"(median over each one's runs) {auto_ms:.2f} vs {ref_ms:.2f} ({100 * (auto_ms / ref_ms - 1):+.1f}%)")
    return out


def format_tables(result: dict) -> str:
    runs = result["runs"]
    lines = ["best lr per optimizer (* best lr at the edge of the lrs tried; 'all': median over the lrs' runs):",
             f"{'optimizer':<42}{'best lr':>10}{'final val':>11}{'opt ms':>9}{'step ms':>9}{'opt share':>11}"
             f"{'opt ms all':>12}{'step ms all':>13}{'runs':>6}"]
    for fam, r in sorted(best_per_family(runs).items(), key=lambda kv: family_order(kv[0])):
        same = [x for x in runs if x["family"] == fam and "error" not in x and not x.get("diverged")]
        lrs = [x["lr"] for x in same]
        edge = "*" if len(set(lrs)) > 1 and r["lr"] in (min(lrs), max(lrs)) else " "
        lines.append(f"{r['label']:<42}{r['lr']:>9g}{edge}{r['final_val_loss']:>11.4f}{r['opt_ms']:>9.2f}"
                     f"{r['step_ms']:>9.2f}{100 * r['opt_share']:>10.1f}%"
                     f"{statistics.median(x['opt_ms'] for x in same):>12.2f}"
                     f"{statistics.median(x['step_ms'] for x in same):>13.2f}{len(same):>6}")
    lines += ["", "all runs:", f"{'config':<36}{'final val':>11}{'opt ms':>9}{'step ms':>9}{'tokens':>12}"]
    for r in sorted(runs, key=lambda r: (family_order(r["family"]), r["lr"] if r["lr"] != "best" else 0)):
        if "error" in r:
            lines.append(f"{r['name']:<36}  error: {r['error'].strip().splitlines()[-1]}")
            continue
        lines.append(f"{r['name']:<36}{r['final_val_loss']:>11.4f}{r['opt_ms']:>9.2f}{r['step_ms']:>9.2f}"
                     f"{r['tokens']:>12d}" + ("  diverged" if r["diverged"] else ""))
    lines += [""] + verdicts(runs)
    return "\n".join(lines)


def plot(result: dict, png: str) -> bool:
    try:
        import matplotlib
        import matplotlib.ticker
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not importable: no plot (use --plot-only JSON later)", file=sys.stderr)
        return False
    best = best_per_family(result["runs"])
    fams = sorted(best, key=family_order)
    tokens_per_step = result["meta"]["tokens_per_step"]
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.2))
    all_fams = sorted({r["family"] for r in result["runs"]}, key=family_order)
    color = {fam: f"C{i}" for i, fam in enumerate(all_fams)}
    for fam in fams:
        r = best[fam]
        lab = f"{r['label']}, lr {r['lr']:g}"
        steps, vals = zip(*r["val_loss"])
        axes[0].plot([s * tokens_per_step / 1e6 for s in steps], vals, marker="o", ms=3, label=lab, color=color[fam])
        train = torch.tensor(r["train_loss"])
        k = max(1, len(train) // 50)
        smooth = train.unfold(0, k, 1).mean(-1) if len(train) >= k else train
        axes[1].plot([(i + k) * tokens_per_step / 1e6 for i in range(len(smooth))], smooth.tolist(), label=lab,
                     color=color[fam])
    lrs = set()
    for fam in all_fams:
        pts = sorted((r["lr"], r["final_val_loss"]) for r in result["runs"]
                     if r["family"] == fam and "error" not in r and not r.get("diverged"))
        if len(pts) > 1:
            axes[2].plot(*zip(*pts), marker="o", label=best[fam]["label"] if fam in best else fam, color=color[fam])
            lrs.update(lr for lr, _ in pts)
    axes[0].set(title="validation loss (best lr each)", xlabel="tokens (M)", ylabel="loss (nats/byte)")
    axes[1].set(title="train loss (moving mean)", xlabel="tokens (M)")
    axes[2].set(title="lr sweep: final validation loss", xlabel="lr", xscale="log")
    for ax in axes[:2]:
        lo = min((min(line.get_ydata()) for line in ax.lines), default=0)
        ax.set_ylim(lo - 0.1, lo + 1.3)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[2].grid(alpha=0.3)
    if lrs:
        axes[2].xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        axes[2].set_xticks(sorted(lrs), [f"{lr:g}" for lr in sorted(lrs)], rotation=45, fontsize=8)
    if axes[2].lines:
        axes[2].legend(fontsize=8)
    else:
        axes[2].text(0.5, 0.5, "no lr sweep", ha="center", transform=axes[2].transAxes)
    meta = result["meta"]
    fig.suptitle(f"{meta['params'] / 1e6:.1f}M-param byte GPT, {meta['tokens_per_run'] / 1e6:.1f}M tokens per run, "
                 f"{meta['device']}, torch {meta['torch']}")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return True


def merge_results(paths: list[str]) -> dict:
    """One result from several runs of this script with the same training settings and corpus."""
    results = []
    for path in paths:
        with open(path) as fh:
            results.append(json.load(fh))
    merged = results[0]
    if len(results) == 1:
        return merged
    keys = ("training", "corpus_sha256_16", "params")
    for path, other in zip(paths[1:], results[1:]):
        diff = [k for k in keys if other["meta"].get(k) != merged["meta"].get(k)]
        if diff:
            raise SystemExit(f"{path}: differs from {paths[0]} in {diff}: not merged")
    merged["meta"]["commands"] = [r["meta"]["command"] for r in results]
    merged["meta"]["configs"] = [c for r in results for c in r["meta"]["configs"]]
    merged["runs"] = [run for r in results for run in r["runs"]]
    return merged


def write_json(result: dict, path: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(result, fh, indent=1)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="*", default=[], help="opt[:f=..][:lr=..][:wd=..] (added to --sweep's)")
    p.add_argument("--sweep", action="store_true", help="3 lrs per optimizer, Dion3 at f 1/2, 1/4, 1/8, and auto")
    p.add_argument("--no-auto", action="store_true", help="leave Dion3 fraction='auto' out of the sweep")
    p.add_argument("--no-aux-variant", action="store_true",
                   help="leave out the sweep's Dion3 f=1/4 run with torch AdamW for the non-matrix parameters")
    p.add_argument("--best-ref", default="dion3:f=0.25", help="the family whose best lr lr=best takes")
    p.add_argument("--gpus", type=int, default=1, help="worker processes, one per GPU (CPU processes without CUDA)")
    p.add_argument("--json", default=None, help="results (default convergence.json; with --plot-only: the merge)")
    p.add_argument("--png", default=None)
    p.add_argument("--plot-only", nargs="+", default=None, metavar="JSON",
                   help="plot and print the tables of finished runs; several files (same training settings) merge")
    p.add_argument("--deadline-s", type=float, default=0, help="start no run that would end after this many seconds")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--ffn", type=int, default=2560)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--max-bytes", type=int, default=64 << 20)
    p.add_argument("--val-frac", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-seed", type=int, default=1234)
    p.add_argument("--aux-lr", type=float, default=3e-3, help="AdamW lr of embedding, head and norms (every run)")
    p.add_argument("--aux-wd", type=float, default=0.0)
    p.add_argument("--warmup-frac", type=float, default=0.05)
    p.add_argument("--final-lr-frac", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--no-bf16", dest="bf16", action="store_false")
    p.add_argument("--eval-every", type=int, default=0, help="0: steps / 5")
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--timing-warmup", type=int, default=10)
    return p


def main(argv: list[str] | None = None) -> dict | None:
    args = parser().parse_args(argv)
    if args.worker is not None:
        worker_main(args.worker, args.gpus)
        return None
    if args.plot_only:
        result = merge_results(args.plot_only)
        if args.json:
            write_json(result, args.json)
        print(format_tables(result))
        if args.png:
            plot(result, args.png)
        return result
    with_auto = args.sweep and not args.no_auto and auto_available()
    if args.sweep and not args.no_auto and not with_auto:
        print("Dion3(fraction='auto') is not available here: the sweep runs without it", file=sys.stderr)
    texts = (sweep_configs(with_auto, not args.no_aux_variant) if args.sweep else []) + args.configs
    if not texts:
        raise SystemExit("nothing to run: give --sweep or --configs")
    configs = [parse_config(t) for t in texts]
    data = load_data(args)
    model = GPT(**model_config(args))
    matrices, others = split_params(model)
    n_params = sum(p.numel() for p in model.parameters())
    del model
    device = torch.device(args.device)
    result = {
        "meta": {
            "date": datetime.date.today().isoformat(),
            "command": "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
            "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "device": device_name(device) if device.type == "cpu" or torch.cuda.is_available() else args.device,
            "gpus": args.gpus, "params": n_params, "matrix_params": sum(p.numel() for p in matrices),
            "other_params": sum(p.numel() for p in others), "model": model_config(args),
            "tokens_per_step": args.batch * args.seq, "tokens_per_run": args.steps * args.batch * args.seq,
            "corpus_bytes": data["bytes"], "corpus_sha256_16": data["sha256"],
            "train_bytes": len(data["train"]), "val_bytes": len(data["val"]),
            "val_tokens": args.eval_batches * args.batch * args.seq,
            "training": training_args(args), "configs": texts, "auto_in_sweep": with_auto,
            "lr_grid": {k: list(v) for k, v in SWEEP_LRS.items()},
        },
        "runs": [],
    }
    print(f"{n_params / 1e6:.2f}M params ({sum(p.numel() for p in matrices) / 1e6:.2f}M in block matrices), "
          f"{result['meta']['tokens_per_run'] / 1e6:.2f}M tokens per run, corpus {data['bytes']} bytes, "
          f"{len(configs)} runs on {args.gpus} worker(s)", flush=True)

    path = args.json or "convergence.json"

    def on_record(done):
        result["runs"] = list(done)
        write_json(result, path)

    run_all(configs, args, on_record)
    write_json(result, path)
    print(format_tables(result))
    if args.png:
        plot(result, args.png)
    return result


if __name__ == "__main__":
    main()
