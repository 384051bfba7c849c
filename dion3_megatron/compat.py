"""How dion3_megatron changes a framework it plugs into (Megatron-Core, Megatron-LM, DeepSpeed,
torchtitan, and ``torch.optim``, where DeepSpeed looks optimizers up): tables of :class:`Patch`
entries, applied and restored here.

Each front end holds its own table, the replacements in it being its own functions, and hands it
to :func:`apply` when it registers and to :func:`restore` when it unregisters: ``MEGATRON`` of
megatron/registry.py and ``LAUNCHER`` of megatron/launch.py, ``DEEPSPEED`` of deepspeed/__init__.py,
``TORCHTITAN`` of torchtitan/registry.py. A behaviour of those frameworks that no table lists is
stock: registration applies exactly the entries of its tables, in order, and nothing else. This
module imports no front end; it knows how to apply, restore and check a table.

:func:`apply` is idempotent, and raises :class:`UpstreamChanged`, naming the attribute, when the
installed framework no longer has one. Every original is kept: :func:`restore` puts each back,
removes what was added (an attribute, a dict item, a list element), and a later :func:`apply`
applies the entries again.

An entry (:class:`Patch`) says

- ``target``: ``module:name`` (an attribute of a module), ``module:Class.name`` (of a class),
  ``module:NAME['key']`` (an item of a dict) or ``module:NAME[+]`` (an element appended to a list);
- ``replacement``: a function of the front end, called with the target's current value (None
  where the target is new) and returning what takes its place;
- ``why``: the behaviour it adds or the bug it mends;
- ``upstream``: the release series whose code it was written against (and read in), as
  ``<distribution> <major.minor>.x ... (read in <version>)``;
- ``when``: :data:`ALWAYS`, or in words the condition that ``only_if`` decides from the current
  value (the entry is skipped where it returns False);
- ``optional``: skipped, instead of failing, where its module does not import (Megatron-LM's
  ``megatron.training`` next to Megatron-Core alone; DeepSpeed for plain torch users);
- ``adds``: the target is new (upstream has no such attribute);
- ``rebinds``: for a function replaced by one whose Dion3 path runs the function's own code with
  some of the globals it reads bound differently (:func:`rebound`), those names. The module keeps
  its own values: nothing is swapped around a call.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import importlib.util
import re
import types
from typing import Any, Callable, Optional

ALWAYS = "always"

MARK = "_dion3_patched"  # set on each replacement function this module installs


class UpstreamChanged(RuntimeError):
    """The installed framework lacks something an entry of a table replaces."""


@dataclasses.dataclass(frozen=True)
class Patch:
    """One change to an attribute of a framework (the fields: the module docstring)."""

    target: str
    replacement: Callable[[Any], Any]
    why: str
    upstream: str
    when: str = ALWAYS
    only_if: Optional[Callable[[Any], bool]] = None
    optional: bool = False
    adds: bool = False
    rebinds: tuple[str, ...] = ()


MEGATRON_EXTRA = 'pip install "dion3-megatron[megatron]"'


def require_megatron() -> None:
    """Raise ImportError naming the install command when Megatron-Core does not import."""
    try:
        found = importlib.util.find_spec("megatron.core") is not None
    except (ImportError, ValueError):  # no megatron package at all, or one that is blocked
        found = False
    if not found:
        raise ImportError(f"dion3_megatron.megatron needs Megatron-Core 0.19, which is not installed: {MEGATRON_EXTRA}")


_TARGET = re.compile(r"(?P<module>[\w.]+):(?P<path>\w+(?:\.\w+)?)(?:\[(?P<key>'\w+'|\+)\])?$")


def _locate(patch: Patch) -> Optional[tuple[Any, str, Optional[str]]]:
    """(owner, name, key) of a target; None when an optional module does not import."""
    match = _TARGET.match(patch.target)
    if match is None:
        raise ValueError(f"dion3_megatron.compat: malformed target {patch.target!r}")
    try:
        owner = importlib.import_module(match["module"])
    except Exception:  # noqa: BLE001 - Megatron-Core without megatron.training, or no DeepSpeed
        if patch.optional:
            return None
        raise
    *outer, name = match["path"].split(".")
    for part in outer:
        owner = _upstream_attribute(patch, owner, part)
    key = match["key"]
    return owner, name, (key.strip("'") if key else None)


def _upstream_attribute(patch: Patch, owner: Any, name: str) -> Any:
    try:
        return getattr(owner, name)
    except AttributeError:
        raise UpstreamChanged(_changed(patch, f"{getattr(owner, '__name__', owner)}.{name} does not exist")) from None


def _changed(patch: Patch, what: str) -> str:
    distribution = patch.upstream.split(" ")[0]
    try:
        installed = f"{distribution} {importlib.metadata.version(distribution)}"
    except importlib.metadata.PackageNotFoundError:
        installed = distribution
    return f"dion3_megatron cannot patch {patch.target}: {what} in the installed {installed}; the entry was written for {patch.upstream}"


def is_patched(value: Any) -> bool:
    """Whether ``value`` is a replacement installed by this module."""
    return getattr(value, MARK, False) is True


_ABSENT = object()


@dataclasses.dataclass(frozen=True)
class _Original:
    """What an applied entry replaced: ``value`` (the raw class or module attribute, or the dict
    item; :data:`_ABSENT` where there was none) or, for a list, the element it appended."""

    owner: Any
    name: str
    key: Optional[str]
    value: Any


# target -> what its applied entry replaced, for restore().
_ORIGINALS: dict[str, _Original] = {}


def _apply(patch: Patch) -> bool:
    """Apply one entry (or see it applied); whether it is in place."""
    located = _locate(patch)
    if located is None:
        return False
    owner, name, key = located
    if key is None:
        current = getattr(owner, name, None) if patch.adds else _upstream_attribute(patch, owner, name)
    else:
        container = _upstream_attribute(patch, owner, name)
        current = None if key == "+" else container.get(key)
    if is_patched(current):
        return True
    if patch.only_if is not None and not patch.only_if(current):
        return False
    _check_rebinds(patch, current)
    new = patch.replacement(current)
    if key == "+":
        if new not in container:
            container.append(new)
            _ORIGINALS[patch.target] = _Original(owner, name, key, new)
    elif new is not current:
        if not patch.adds and isinstance(new, types.FunctionType):
            setattr(new, MARK, True)
        if key is None:  # the raw attribute (a staticmethod stays one), absent where it was inherited
            _ORIGINALS[patch.target] = _Original(owner, name, key, vars(owner).get(name, _ABSENT))
            setattr(owner, name, new)
        else:
            _ORIGINALS[patch.target] = _Original(owner, name, key, container.get(key, _ABSENT))
            container[key] = new
    return True


def _restore(original: _Original) -> None:
    if original.key == "+":
        container = getattr(original.owner, original.name)
        if original.value in container:
            container.remove(original.value)
    elif original.key is not None:
        container = getattr(original.owner, original.name)
        if original.value is _ABSENT:
            container.pop(original.key, None)
        else:
            container[original.key] = original.value
    elif original.value is _ABSENT:
        if original.name in vars(original.owner):
            delattr(original.owner, original.name)
    else:
        setattr(original.owner, original.name, original.value)


def restore(patches: tuple[Patch, ...]) -> None:
    """Undo the applied entries of ``patches`` (in reverse order): every replaced attribute and dict
    item is its original again, every added attribute, dict item and list element is gone."""
    for patch in reversed(patches):
        original = _ORIGINALS.pop(patch.target, None)
        if original is not None:
            _restore(original)


def _check_rebinds(patch: Patch, function: Any) -> None:
    read = set(getattr(getattr(function, "__code__", None), "co_names", ()))
    missing = [name for name in patch.rebinds if name not in read]
    if missing:
        raise UpstreamChanged(_changed(patch, f"the function no longer reads {', '.join(missing)}"))


def rebound(patches: tuple[Patch, ...], target: str, function: Callable, values: dict[str, Any]) -> Callable:
    """``function``'s own code, run with the globals named in ``values`` bound to those values (the
    entry of ``target`` in ``patches`` lists the names). Its module keeps its own values, so other
    callers, other threads and the functions it calls see the stock ones."""
    (patch,) = [p for p in patches if p.target == target]
    assert sorted(values) == sorted(patch.rebinds), (target, sorted(values), patch.rebinds)
    _check_rebinds(patch, function)
    copy = types.FunctionType(
        function.__code__, {**function.__globals__, **values}, function.__name__, function.__defaults__, function.__closure__
    )
    copy.__kwdefaults__ = function.__kwdefaults__
    return copy


def apply(patches: tuple[Patch, ...]) -> dict[str, bool]:
    """Apply ``patches`` in order; {target: whether it is in place}."""
    return {patch.target: _apply(patch) for patch in patches}


__all__ = [
    "ALWAYS",
    "MARK",
    "Patch",
    "UpstreamChanged",
    "apply",
    "is_patched",
    "rebound",
    "require_megatron",
    "restore",
]
