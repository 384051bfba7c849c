"""The environment report of ``python -m dion3_megatron``: versions; each front end, "yes" where its
framework is installed at the version its extra asks for (pyproject.toml) and it imports, else why
not; whether the step uses each kind of GPU kernel, else every reason why not; and the f that
``fraction="auto"`` would choose for given shapes on this machine.

Megatron-Core, DeepSpeed and transformers are imported only when a report asks whether their front
end imports, never when this module is imported.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import io
import os
import pathlib
import platform
import re
import tomllib
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

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


def installed_version(distribution: str) -> Optional[str]:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> list[Line]:
    from . import __version__

    lines = [Line("python", f"{platform.python_version()} ({platform.platform()})"), Line("dion3-megatron", __version__)]
    lines += [Line(d, installed_version(d) or "not installed") for d in DISTRIBUTIONS]
    lines.append(Line("torch CUDA build", torch.version.cuda or "none (CPU build)"))
    return lines


PYPROJECT = pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml"  # where the package is a source tree's


def declared_requirements(pyproject: pathlib.Path = PYPROJECT) -> dict[Optional[str], list[str]]:
    """dion3-megatron's requirements by extra (None: the base dependencies): those of the
    pyproject.toml of the source tree the package is imported from, else the installed metadata's;
    empty where neither is found."""
    if pyproject.is_file():
        project = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {})
        if project.get("name") == "dion3-megatron":
            return {None: project.get("dependencies", []), **project.get("optional-dependencies", {})}
    try:
        requirements = importlib.metadata.requires("dion3-megatron") or []
    except importlib.metadata.PackageNotFoundError:
        return {}
    declared: dict[Optional[str], list[str]] = {}
    for text in requirements:
        requirement, _, marker = text.partition(";")
        extra = re.search(r"extra\s*==\s*[\"']([^\"']+)", marker)
        declared.setdefault(extra[1] if extra else None, []).append(requirement.strip())
    return declared


_REQUIREMENT = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*(.*)")
_CLAUSE = re.compile(r"(==|!=|>=|<=|~=|>|<)\s*(\d+(?:\.\d+)*)(\.\*)?")


def release(version: str) -> tuple[int, ...]:
    """The release numbers of a version: '2.14.1+cu130' -> (2, 14, 1); '0.19.0rc1' -> (0, 19, 0)."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(part) for part in match[0].split(".")) if match else ()


def satisfies(version: str, specifier: str) -> bool:
    """``version`` meets every clause of ``specifier`` (``>=0.19,<0.20``, ``==0.19.*``, ``~=4.8``),
    compared by release numbers; ValueError naming a clause of another form."""
    have = release(version)
    for clause in filter(None, (c.strip() for c in specifier.split(","))):
        match = _CLAUSE.fullmatch(clause)
        if match is None:
            raise ValueError(f"a version clause is an operator and a version, e.g. >=0.19, got {clause!r}")
        operator, text, wildcard = match.groups()
        want = release(text)
        if wildcard:  # ==X.Y.* / !=X.Y.*: the release starts with X.Y
            ok = (have[: len(want)] == want) == (operator == "==")
        else:
            width = max(len(have), len(want))
            a, b = have + (0,) * (width - len(have)), want + (0,) * (width - len(want))
            compatible = a >= b and a[: len(want) - 1] == b[: len(want) - 1]
            ok = {"==": a == b, "!=": a != b, ">=": a >= b, "<=": a <= b, ">": a > b, "<": a < b, "~=": compatible}[operator]
        if not ok:
            return False
    return True


def unmet(requirements: Iterable[str]) -> list[str]:
    """Why each of these requirements is not met here: 'X not installed' or 'X 0.18.0 installed,
    ==0.19.* needed'."""
    why = []
    for requirement in requirements:
        name, specifier = _REQUIREMENT.fullmatch(requirement).groups()  # type: ignore[union-attr]
        found = installed_version(name)
        if found is None:
            why.append(f"{name} not installed")
        elif specifier and not satisfies(found, specifier):
            why.append(f"{name} {found} installed, {specifier} needed")
    return why


def _imports(modules: Iterable[str]) -> str:
    """'yes', or 'no (<the error>)': the modules imported with their own printing captured."""
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            for name in modules:
                importlib.import_module(name)
    except Exception as error:  # noqa: BLE001 - any failure to import is the answer
        return f"no ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"
    return "yes"


@dataclass(frozen=True)
class FrontEnd:
    label: str
    extra: Optional[str]  # the extra that installs its framework; None: torch alone (the base dependencies)
    modules: tuple[str, ...]  # what it imports: the framework's modules, then the front end's


FRONT_ENDS: tuple[FrontEnd, ...] = (
    FrontEnd("torch (dion3_megatron.Dion3)", None, ("dion3_megatron.optimizer",)),
    FrontEnd("FSDP2 / DTensor", None, ("torch.distributed.tensor", "torch.distributed.fsdp", "dion3_megatron.frontend.dtensor")),
    FrontEnd("Megatron-Core (--optimizer dion3)", "megatron", ("megatron.core", "dion3_megatron.megatron")),
    FrontEnd('DeepSpeed ("type": "Dion3")', "deepspeed", ("deepspeed", "dion3_megatron.deepspeed")),
    FrontEnd("Hugging Face Trainer", "hf", ("deepspeed", "accelerate", "transformers.trainer", "dion3_megatron.deepspeed")),
    FrontEnd(
        'torchtitan ("Dion3" in its optimizer config)', "torchtitan", ("torchtitan.components.optimizer", "dion3_megatron.torchtitan")
    ),
)


def front_end_status(front_end: FrontEnd, declared: dict[Optional[str], list[str]]) -> str:
    """'yes' where its framework is installed at the version its extra asks for and everything
    imports; else 'no: ' and why, with the command that installs it."""
    why = unmet(declared.get(front_end.extra, []))
    if why:
        return f'no: {"; ".join(why)} (pip install "dion3-megatron{f"[{front_end.extra}]" if front_end.extra else ""}")'
    return _imports(front_end.modules)


def front_ends() -> list[Line]:
    declared = declared_requirements()
    lines = [Line(front_end.label, front_end_status(front_end, declared)) for front_end in FRONT_ENDS]
    if not declared:
        lines.append(Line("versions asked for", "unknown: no pyproject.toml beside the package and no installed dion3-megatron"))
    return lines


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def gpu() -> Line:
    if not torch.cuda.is_available():
        return Line("GPU", "none (CUDA not available): the step runs on the CPU")
    index = torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    return Line("GPU", f"{torch.cuda.get_device_name(index)} (compute capability {major}.{minor}, {torch.cuda.device_count()} visible)")


def _turned_off(variable: str, config_field: str) -> str:
    """Why a configuration turns kernels off: the environment's default or a configuration set in code."""
    return f"{variable}=0" if os.environ.get(variable) == "0" else f"{config_field} set in code (dion3_megatron.kernels.configure)"


def symmetric_kernels(here: torch.device, declared: dict[Optional[str], list[str]]) -> str:
    """'on' or 'off: ' and every reason: packages missing, no GPU, not a Hopper, turned off."""
    from .kernels import current
    from .kernels.symm import backend

    reasons = []
    absent = backend.missing()
    if absent:
        half = backend.half_installed()
        reasons.append(
            f"{half}: {backend.COST} ({backend.INSTALL})" if half else f"{' and '.join(absent)} not installed ({backend.INSTALL})"
        )
    if here.type != "cuda":
        reasons.append("no GPU")
    elif torch.cuda.get_device_capability(here) != (9, 0):
        major, minor = torch.cuda.get_device_capability(here)
        reasons.append(f"not a Hopper GPU (compute capability {major}.{minor}; the kernels need 9.0)")
    if current().kernels == "torch":
        reasons.append(_turned_off("DION3_KERNELS", "kernels='torch'"))
    untested = [why for why in unmet(declared.get("kernels", [])) if "not installed" not in why]
    note = f" ({'; '.join(untested)}: untested)" if untested else ""
    if reasons:
        return f"off: {'; '.join(reasons)}{note}"
    return f"on, where a product fills the GPU (--shape says for a shape){note}"


def row_kernels(here: torch.device) -> str:
    """'on' or 'off: ' and every reason: triton missing, no GPU, turned off, no compiler."""
    from .kernels import current
    from .kernels import rows

    config = current()
    reasons = []
    if importlib.util.find_spec("triton") is None:
        reasons.append("triton not installed (it comes with torch's CUDA wheels)")
    if here.type != "cuda":
        reasons.append("no GPU")
    if config.kernels == "torch":
        reasons.append(_turned_off("DION3_KERNELS", "kernels='torch'"))
    elif not config.fused_rows:
        reasons.append(_turned_off("DION3_FUSED_ROWS", "fused_rows=False"))
    if not reasons and not rows.runs_on(here):
        reasons.append("a Triton kernel does not build here (no C compiler?)")
    return f"off: {'; '.join(reasons)}" if reasons else "on"


def kernels() -> list[Line]:
    """Whether the step uses each kind of kernel here, and if not, every reason why."""
    from .kernels import current

    config = current()
    here = device()
    return [
        Line("symmetric-GEMM kernels (CuTe DSL)", symmetric_kernels(here, declared_requirements())),
        Line("row kernels (Triton)", row_kernels(here)),
        Line(
            "kernel setting",
            f"kernels={config.kernels!r}, fused_rows={config.fused_rows} (DION3_KERNELS=0 / DION3_FUSED_ROWS=0 turn them off)",
        ),
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
        ("front ends", front_ends),
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
