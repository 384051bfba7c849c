"""The environment report of ``python -m dion3_megatron``: versions, the front ends that import, the
GPU kernels and whether the step would use them, and the f that ``fraction="auto"`` would choose for
given shapes on this machine.

Megatron-Core, DeepSpeed and transformers are imported only when a report asks whether their front
end imports, never when this module is imported.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import io
import platform
import re
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

DISTRIBUTIONS = (
    "torch",
    "megatron-core",
    "deepspeed",
    "transformers",
    "accelerate",
    "torchtitan",
    "nvidia-cutlass-dsl",
    "apache-tvm-ffi",
    "triton",
)


@dataclass(frozen=True)
class Line:
    label: str
    value: str


def version_of(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def versions() -> list[Line]:
    from . import __version__

    lines = [Line("python", f"{platform.python_version()} ({platform.platform()})"), Line("dion3-megatron", __version__)]
    lines += [Line(d, version_of(d)) for d in DISTRIBUTIONS]
    lines.append(Line("torch CUDA build", torch.version.cuda or "none (CPU build)"))
    return lines


def _imports(modules: Iterable[str]) -> str:
    """'yes', or 'no (<the error>)': the modules imported with their own printing captured."""
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            for name in modules:
                importlib.import_module(name)
    except Exception as error:  # noqa: BLE001 - any failure to import is the answer
        return f"no ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"
    return "yes"


FRONT_ENDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("torch (dion3_megatron.Dion3)", ("dion3_megatron.optimizer",)),
    ("FSDP2 / DTensor", ("torch.distributed.tensor", "torch.distributed.fsdp", "dion3_megatron.frontend.dtensor")),
    ("Megatron-Core (--optimizer dion3)", ("dion3_megatron.megatron",)),
    ('DeepSpeed ("type": "Dion3")', ("dion3_megatron.deepspeed",)),
    ("Hugging Face Trainer", ("transformers.trainer", "dion3_megatron.deepspeed")),
    ('torchtitan ("Dion3" in its optimizer config)', ("torchtitan.components.optimizer", "dion3_megatron.torchtitan")),
)


def front_ends() -> list[Line]:
    return [Line(label, _imports(modules)) for label, modules in FRONT_ENDS]


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def gpu() -> Line:
    if not torch.cuda.is_available():
        return Line("GPU", "none (CUDA not available): the step runs on the CPU")
    index = torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    return Line("GPU", f"{torch.cuda.get_device_name(index)} (compute capability {major}.{minor}, {torch.cuda.device_count()} visible)")


def kernels() -> list[Line]:
    """The kernels present, and why the step would or would not use them here."""
    from . import kernels as k
    from .kernels import rows

    config = k.current()
    installed = k.kernels_installed()
    lines = [
        Line("symmetric-GEMM kernels (CuTe DSL)", "installed" if installed else "not installed (pip install 'dion3-megatron[kernels]')"),
        Line("row kernels (Triton)", "installed" if importlib.util.find_spec("triton") else "not installed (triton)"),
        Line(
            "kernel setting",
            f"kernels={config.kernels!r}, fused_rows={config.fused_rows} (DION3_KERNELS=0 / DION3_FUSED_ROWS=0 turn them off)",
        ),
    ]
    here = device()
    if here.type != "cuda":
        why = "not routed: no CUDA device, the step runs plain torch"
        return lines + [Line("symmetric GEMMs routed", why), Line("row kernels routed", why)]
    probe = torch.empty(1, device=here)
    if config.kernels == "torch":
        symmetric = "not routed: kernels='torch'"
    elif not k.kernel_capable_device(probe):
        symmetric = (
            "not routed: the kernels are not installed" if not installed else "not routed: not a Hopper GPU (compute capability 9.0)"
        )
    else:
        symmetric = "routed where a product fills the GPU (per shape below)"
    rows_on = rows.available() and rows.runs_on(here)
    return lines + [
        Line("symmetric GEMMs routed", symmetric),
        Line("row kernels routed", "yes" if rows_on else "not routed: off, triton missing or no compiler"),
    ]


def parse_shape(text: str) -> tuple[int, int]:
    """'4096x14336' -> (4096, 14336); ValueError naming the value otherwise."""
    match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not match or min(int(match[1]), int(match[2])) < 1:
        raise ValueError(f"a shape is ROWSxCOLS with positive integers, e.g. 4096x14336, got {text!r}")
    return int(match[1]), int(match[2])


def auto_choices(shapes: Iterable[tuple[int, int]], world: int = 1, batch: int = 1) -> list[Line]:
    """What ``fraction="auto"`` chooses for each shape on this machine's first device: the engine's
    own request (:func:`dion3_megatron.engine.fractions.choose_fractions`) on the speed it measures,
    with the library's default settings, ``batch`` same-shape matrices stepped together over
    ``world`` ranks."""
    from .core.ortho import default_ns_dtype
    from .core.rule import selected_row_count
    from .engine import fractions
    from .kernels import current, kernel_capable_device, routes_to_kernel
    from .options import hyperparameters

    here = device()
    hp = hyperparameters()
    dtype = hp.ns_dtype or default_ns_dtype(here)
    shapes = list(shapes)
    requests = [fractions.FractionRequest(shape, batch, world, hp, here) for shape in shapes]
    chosen = fractions.choose_fractions(requests)
    capable = here.type == "cuda" and current().kernels != "torch" and kernel_capable_device(torch.empty(1, device=here))
    lines = []
    for (n, c), f in zip(shapes, chosen):
        k = selected_row_count(n, f, hp.num_heads)
        s, length = min(k, c), max(k, c)
        routed = capable and routes_to_kernel(batch, s, length, dtype)
        lines.append(
            Line(
                f"{n}x{c}",
                f"f = {f:g} ({k} of {n} rows per step; Gram product {s}x{s} over {length}: "
                f"{'symmetric-GEMM kernel' if routed else 'torch'})",
            )
        )
    return lines


def sections(shapes: Iterable[tuple[int, int]], world: int = 1, batch: int = 1) -> list[tuple[str, Callable[[], list[Line]]]]:
    """The report's sections, each computed when printed."""
    shapes = list(shapes)
    out: list[tuple[str, Callable[[], list[Line]]]] = [
        ("versions", versions),
        ("front ends (import)", front_ends),
        ("device and kernels", lambda: [gpu(), *kernels()]),
    ]
    if shapes:
        where = "GPU" if torch.cuda.is_available() else "CPU"
        title = f'fraction="auto" on this {where} (--world {world}, --batch {batch})'
        out.append((title, lambda: auto_choices(shapes, world, batch)))
    return out


def render(title: str, lines: list[Line]) -> str:
    width = max((len(line.label) for line in lines), default=0)
    return "\n".join([title, *(f"  {line.label:<{width}}  {line.value}" for line in lines)])
