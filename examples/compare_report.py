"""What the Megatron-Core GPT example (examples/pretrain_gpt.py) reports on rank 0: the table, the
one-line verdict, the JSON of every run and the loss plot (vs step and vs wall-clock seconds)."""

from __future__ import annotations

import json
import os

import torch

LABELS = {"dion3": "Dion3", "adam": "AdamW", "muon": "Muon"}
SMOOTH_POINTS = 50  # the plotted train loss: a moving mean over steps / 50 steps
YLIM_AT = 0.15  # the plot's y-axis tops out near the loss at 15% of training, not at the initial ~5.5
STYLES = {
    "dion3": dict(color="C0", linestyle="-", linewidth=1.8, marker="o"),
    "adam": dict(color="C1", linestyle=":", linewidth=1.6, marker="s"),
    "muon": dict(color="C2", linestyle="--", linewidth=1.6, marker="^"),
}


def output_stem(compare: bool, optimizers: list[str]) -> str:
    """The file name (without extension) of a run's JSON and PNG: compare, else e.g. dion3 or dion3+adam."""
    return "compare" if compare else "+".join(optimizers)


def speedups_vs_muon(results: list[dict]) -> dict[str, float]:
    """Muon's optimizer-step time / each optimizer's (above 1: faster than Muon); empty without Muon."""
    ok = {r["optimizer"]: r for r in results if "error" not in r}
    if "muon" not in ok:
        return {}
    return {name: ok["muon"]["optimizer_ms"] / r["optimizer_ms"] for name, r in ok.items()}


def _times(speedup: float) -> str:
    if round(speedup, 2) == 1:
        return "1.00x"
    return f"{speedup:.2f}x faster" if speedup > 1 else f"{1 / speedup:.2f}x slower"


def table(results: list[dict], skipped: dict[str, str]) -> str:
    """The results as a text table, one row per optimizer (failed and skipped ones say so)."""
    speedups = speedups_vs_muon(results)
    rows = [("optimizer", "mode", "final train loss*", "validation loss", "opt. step ms", "vs Muon", "tokens/s", "seconds")]
    for r in results:
        if "error" in r:
            rows.append((r["label"], "-", "failed", "-", "-", "-", "-", "-"))
            continue
        vs = speedups.get(r["optimizer"])
        rows.append(
            (
                r["label"],
                r["mode"],
                f"{r['final_train_loss']:.4f}",
                f"{r['final_val_loss']:.4f}",
                f"{r['optimizer_ms']:.2f}",
                "-" if vs is None else _times(vs),
                f"{r['tokens_per_s']:,.0f}",
                f"{r['train_seconds']:.1f}",
            )
        )
    rows += [(LABELS[name], "-", "skipped", "-", "-", "-", "-", "-") for name in skipped]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    rule = "+-" + "-+-".join("-" * w for w in widths) + "-+"
    lines = [rule]
    for i, row in enumerate(rows):
        lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")
        if i == 0:
            lines.append(rule)
    return "\n".join([*lines, rule])


def footnotes(results: list[dict]) -> str:
    done = [r for r in results if "error" not in r]
    if not done:
        return ""
    r = done[0]
    return (
        f"* final train loss: mean over the last 10% of the steps ({r['final_train_steps']}); validation loss: "
        f"on the held-out 5% of the tokens, at the end.\n"
        f"  opt. step ms: median time of Megatron's optimizer.step() on rank 0 (grad copy, clip, update,\n"
        f"  param all-gather) over steps {r['optimizer_ms_from_step']}-{len(r['train_loss'])}; "
        f"vs Muon: Muon's step time / this one's."
    )


def verdict(results: list[dict], skipped: dict[str, str], fraction) -> str | None:
    """One line: Dion3's validation loss against Muon's (and AdamW's), and its optimizer step against
    Muon's with both layouts named; None when Dion3 was not asked for."""
    runs = {r["optimizer"]: r for r in results}
    if "dion3" not in runs:
        return None
    dion3 = runs["dion3"]
    if "error" in dion3:
        return f"Dion3 f={fraction} failed (see above): no verdict"
    muon = runs.get("muon")
    muon_ok = muon is not None and "error" not in muon
    loss = f"Dion3 f={fraction}: validation loss {dion3['final_val_loss']:.3f}"
    if muon_ok:
        loss += f" vs Muon {muon['final_val_loss']:.3f} ({dion3['final_val_loss'] - muon['final_val_loss']:+.3f})"
    adam = runs.get("adam")
    if adam is not None:
        loss += ", AdamW " + ("failed" if "error" in adam else f"{adam['final_val_loss']:.3f}")
    step = f"Dion3 optimizer step {dion3['optimizer_ms']:.2f} ms ({dion3['mode']})"
    if muon is None and "muon" not in skipped:
        return f"{loss}; {step}; --compare adds Muon and AdamW"
    if not muon_ok:
        return f"{loss}; Muon {'failed' if muon else 'skipped'}, so no step-time comparison; {step}"
    speedup = speedups_vs_muon(results)["dion3"]
    faster = f"{speedup:.1f}x faster" if speedup >= 1 else f"{1 / speedup:.1f}x slower"
    layouts = f"{dion3['mode']} both" if dion3["mode"] == muon["mode"] else f"Dion3 {dion3['mode']}, Muon {muon['mode']}"
    return f"{loss}; optimizer step {faster} than Muon ({dion3['optimizer_ms']:.2f} vs {muon['optimizer_ms']:.2f} ms, {layouts})"


def _smoothed(losses: list[float]) -> tuple[int, list[float]]:
    """(window, moving mean over the window; entry i ends at step window + i)."""
    k = max(1, len(losses) // SMOOTH_POINTS)
    t = torch.tensor(losses)
    return k, (torch.nn.functional.avg_pool1d(t[None, None], k, 1)[0, 0].tolist() if k > 1 else losses)


def _ylim(train: list[list[float]], val: list[float]) -> tuple[float, float] | None:
    """From a bit below the lowest loss to a bit above the highest train loss at ~15% of training."""
    top = max(c[min(int(len(c) * YLIM_AT), len(c) - 1)] for c in train)
    low = min(min(c) for c in [*train, val])
    return None if top <= low else (low - 0.05 * (top - low), top + 0.1 * (top - low))


def plot_figure(results: list[dict], meta: dict):
    """Two panels: loss vs step and loss vs training wall-clock seconds (validation as markers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 5), sharey=True)
    train, val, window = [], [], 1
    for r in (x for x in results if "error" not in x):
        style = dict(STYLES[r["optimizer"]])
        marker = style.pop("marker")
        window, smooth = _smoothed(r["train_loss"])
        steps = list(range(window, len(r["train_loss"]) + 1))
        seconds = r["train_time"][window - 1 :]
        val_steps, vals = zip(*r["val_loss"])
        val_seconds = [r["train_time"][s - 1] for s in val_steps]
        for ax, xs, val_xs in ((by_step, steps, val_steps), (by_time, seconds, val_seconds)):
            ax.plot(xs, smooth, label=f"{r['label']} train", **style)
            ax.plot(
                val_xs,
                vals,
                linestyle="none",
                marker=marker,
                color=style["color"],
                markersize=5,
                label=f"{r['label']} validation ({r['final_val_loss']:.3f})",
            )
        train.append(smooth)
        val += vals
    limits = _ylim(train, val) if train else None
    if limits:
        by_step.set_ylim(*limits)
    by_step.set_xlabel("step")
    by_time.set_xlabel("training wall-clock seconds (validation excluded)")
    by_step.set_ylabel("loss (nats/token)")
    smoothing = f"train loss, moving mean over {window} steps" if window > 1 else "train loss, per step"
    for ax in (by_step, by_time):
        ax.grid(alpha=0.3)
    by_step.legend(title=f"{smoothing}; markers: validation", fontsize=8, title_fontsize=8)
    fig.suptitle(
        f"{meta['model']}, {meta['data']}\n{meta['device'].upper()}, TP={meta['tp']} DP={meta['dp']}, "
        f"{meta['steps']} steps of {meta['global_batch']} sequences",
        fontsize=9,
    )
    fig.tight_layout()
    return fig


def save_plot(results: list[dict], meta: dict, path: str) -> str:
    """The PNG's path, or why there is none (matplotlib missing)."""
    try:
        fig = plot_figure(results, meta)
    except ImportError as e:
        return f"(no plot: {e}; pip install matplotlib)"
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def report(args, results: list[dict], skipped: dict[str, str], meta: dict) -> None:
    """Print the table, its footnotes and the verdict; write the JSON (always) and the PNG."""
    print("\n" + table(results, skipped))
    notes = footnotes(results)
    if notes:
        print(notes)
    for name, why in skipped.items():
        print(f"{LABELS[name]} was skipped: {why}")
    for r in results:
        if "error" in r:
            print(f"{r['label']} failed: {r['error']}")
    for name, speedup in speedups_vs_muon(results).items():
        next(r for r in results if r["optimizer"] == name)["speedup_vs_muon"] = round(speedup, 3)
    line = verdict(results, skipped, meta["dion3_fraction"])
    if line:
        print(f"\nverdict: {line}")
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, output_stem(args.compare, args.optimizers))
    with open(stem + ".json", "w") as f:
        json.dump(dict(meta, results=results, skipped=skipped, verdict=line), f, indent=1)
    print(f"\nwrote {stem}.json and {save_plot(results, meta, stem + '.png')}", flush=True)
