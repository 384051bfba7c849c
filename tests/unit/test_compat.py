"""dion3_megatron.compat and the tables of patches the front ends hand it (Megatron's, its
launcher's, DeepSpeed's, torchtitan's): every Patch the package builds is in one of them; each
front end's registration changes exactly the attributes its tables list; applying twice changes
nothing; unregistering puts every original back; every entry is written for the installed
framework version; an attribute upstream no longer has fails by name."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import re
import subprocess
import sys
import textwrap
import types

import pytest

from dion3_megatron import compat

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("deepspeed") is None:
    pytest.skip("needs megatron-core and deepspeed", allow_module_level=True)

from support.deepspeed_helpers import import_keeping_environment  # noqa: E402

# DeepSpeed's import changes os.environ, which processes other tests start later would inherit.
import_keeping_environment("dion3_megatron.deepspeed")

# Each front end (dion3_megatron.<name>): the framework it needs, the arguments of its register(),
# and the tables of patches that registration applies.
FRONT_ENDS: dict[str, tuple[str, dict, tuple[str, ...]]] = {
    "megatron": (
        "megatron.core",
        {"launcher": True},
        ("dion3_megatron.megatron.registry:MEGATRON", "dion3_megatron.megatron.launch:LAUNCHER"),
    ),
    "deepspeed": ("deepspeed", {}, ("dion3_megatron.deepspeed:DEEPSPEED",)),
    "torchtitan": ("torchtitan.components.optimizer", {}, ("dion3_megatron.torchtitan.registry:TORCHTITAN",)),
}
INSTALLED = {name: spec for name, spec in FRONT_ENDS.items() if importlib.util.find_spec(spec[0].split(".")[0]) is not None}
TABLES = {table: name for name, (_, _, tables) in FRONT_ENDS.items() for table in tables}


def _param(value: str, front_end: str):
    return pytest.param(value, id=value, marks=[] if front_end in INSTALLED else [pytest.mark.skip(reason=f"{front_end} not installed")])


FRONT_END_PARAMS = [_param(name, name) for name in FRONT_ENDS]
TABLE_PARAMS = [_param(table, name) for table, name in TABLES.items()]


def table(path: str) -> tuple[compat.Patch, ...]:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


# In a fresh interpreter, with registration held back: import every front end and every module its
# tables touch; list every Patch alive that is in none of the tables; note every attribute of every
# module of the frameworks (and of the classes, dict items and list elements they hold), and what
# each entry's target holds. Then register each front end, noting again after each; apply every
# table and register again, noting again; unregister every front end; register again.
_SCRIPT = textwrap.dedent("""
    import gc, importlib, json, os, sys, types
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from dion3_megatron import compat

    FRONT_ENDS = json.loads(sys.argv[1])
    apply = compat.apply
    compat.apply = lambda patches: {p.target: False for p in patches}  # held back
    front_ends = {name: importlib.import_module(f"dion3_megatron.{name}") for name in FRONT_ENDS}
    tables = {}
    for path in [path for _, _, paths in FRONT_ENDS.values() for path in paths]:
        module, _, name = path.partition(":")
        tables[path] = getattr(importlib.import_module(module), name)
    for patches in tables.values():
        for patch in patches:
            importlib.import_module(patch.target.split(":")[0])
    compat.apply = apply
    in_tables = {id(patch) for patches in tables.values() for patch in patches}
    stray = sorted(o.target for o in gc.get_objects() if isinstance(o, compat.Patch) and id(o) not in in_tables)

    # A dict or list can be reachable from several modules (megatron.core.optimizer re-exports
    # _EMERGING_OPTIMIZERS): note it under the name its entry uses.
    named = {}
    for patches in tables.values():
        for patch in patches:
            module, _, path = patch.target.partition(":")
            if "[" in path:
                named[id(getattr(sys.modules[module], path.split("[")[0]))] = f"{module}:{path.split('[')[0]}"

    def ours(value):
        return (getattr(value, "__module__", None) or "").startswith("dion3_megatron")

    def note():
        seen, held = {}, set()
        for name, module in list(sys.modules.items()):
            if module is None or not (name.split(".")[0] in ("megatron", "deepspeed", "torchtitan") or name == "torch.optim"):
                continue
            for attr, value in list(vars(module).items()):
                if attr.startswith("__") or isinstance(value, types.ModuleType):
                    continue
                where = f"{name}:{attr}"
                seen[where] = id(value)
                held |= {where} if ours(value) else set()
                # A class under its own name (megatron-core keeps aliases: AdamOptimizerConfig = OptimizerConfig)
                if isinstance(value, type) and value.__module__ == name and value.__name__ == attr:
                    for key, item in list(vars(value).items()):
                        seen[f"{where}.{key}"] = id(item)
                        held |= {f"{where}.{key}"} if ours(item) else set()
                elif isinstance(value, dict):
                    where = named.get(id(value), where)
                    for key, item in list(value.items()):
                        if isinstance(key, str):
                            seen[f"{where}[{key!r}]"] = id(item)
                            held |= {f"{where}[{key!r}]"} if ours(item) or ours(getattr(item, "optimizer_cls", None)) else set()
                elif isinstance(value, list):
                    where = named.get(id(value), where)
                    seen[f"{where}[+]"] = [id(item) for item in value]
                    held |= {f"{where}[+]"} if any(ours(item) for item in value) else set()
        return seen, held

    def holds(patch):
        owner, name, key = compat._locate(patch)
        if key is None:  # the raw attribute, absent where inherited or new
            return vars(owner).get(name, "absent")
        container = getattr(owner, name)
        return list(container) if key == "+" else container.get(key, "absent")

    def same(a, b):
        if isinstance(a, list):
            return isinstance(b, list) and len(a) == len(b) and all(x is y for x, y in zip(a, b))
        return a is b

    originals = {path: [holds(p) for p in patches] for path, patches in tables.items()}
    changed = {}
    before, _ = note()
    for name, (_, arguments, _) in FRONT_ENDS.items():
        front_ends[name].register(**arguments)
        after, held = note()
        modules = {k.split(":")[0] for k in before}
        changed[name] = sorted(k for k in after if k in before and after[k] != before[k]) + sorted(
            k for k in set(after) - set(before) if k.split(":")[0] in modules)  # (not what a new module holds)
        before = after
    applied = {path: apply(patches) for path, patches in tables.items()}
    for name, (_, arguments, _) in FRONT_ENDS.items():
        front_ends[name].register(**arguments)
    again, _ = note()
    for name in reversed(list(FRONT_ENDS)):
        front_ends[name].unregister()
    restored = {path: [p.target for p, held_before in zip(patches, originals[path]) if same(holds(p), held_before)]
                for path, patches in tables.items()}
    for name, (_, arguments, _) in FRONT_ENDS.items():
        front_ends[name].register(**arguments)
    registered_again = {path: [p.target for p, held_before in zip(patches, originals[path]) if not same(holds(p), held_before)]
                        for path, patches in tables.items()}
    print("RESULT" + json.dumps(dict(
        stray=stray, changed=changed, held=sorted(held), applied=applied, same=again == before,
        differ=sorted(k for k in set(again) | set(before) if again.get(k) != before.get(k)),
        restored=restored, registered_again=registered_again)))
""")


@pytest.fixture(scope="module")
def audit():
    out = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(INSTALLED)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    (line,) = [line for line in out.stdout.splitlines() if line.startswith("RESULT")]
    return json.loads(line[len("RESULT") :])


def targets(paths) -> list[str]:
    return [patch.target for path in paths for patch in table(path)]


@pytest.mark.slow  # (the audit runs one process per front end)
def test_every_patch_the_package_builds_is_in_a_table(audit):
    assert audit["stray"] == [], "a Patch outside every table: compat's audits do not see it"


@pytest.mark.slow  # (the audit runs one process per front end)
@pytest.mark.parametrize("front_end", FRONT_END_PARAMS)
def test_registration_changes_exactly_the_attributes_its_tables_list(audit, front_end):
    listed = set(targets(FRONT_ENDS[front_end][2]))
    changed = set(audit["changed"][front_end])
    assert changed - listed == set(), f"changed by dion3_megatron.{front_end}.register() but in none of its tables"
    assert changed == listed
    # No apex or Transformer Engine here, the dataset helpers come compiled: every entry applies.
    for path in FRONT_ENDS[front_end][2]:
        assert audit["applied"][path] == {target: True for target in targets([path])}


@pytest.mark.slow  # (the audit runs one process per front end)
def test_every_attribute_holding_the_packages_objects_is_in_a_table(audit):
    assert set(audit["held"]) - set(targets([t for _, _, paths in INSTALLED.values() for t in paths])) == set()


@pytest.mark.slow  # (the audit runs one process per front end)
def test_applying_twice_changes_nothing(audit):
    assert audit["same"], audit["differ"]


@pytest.mark.slow  # (the audit runs one process per front end)
@pytest.mark.parametrize("path", TABLE_PARAMS)
def test_unregister_restores_every_original_and_register_works_again(audit, path):
    assert audit["restored"][path] == targets([path])
    assert audit["registered_again"][path] == targets([path])


_UPSTREAM = re.compile(r"(?P<distribution>[\w-]+) (?P<series>\d+\.\d+)\.x\b.* \(read in (?P<read>\d+\.\d+\.\d+)\)")


@pytest.mark.parametrize("path", TABLE_PARAMS)
def test_entries_are_complete_and_written_for_the_installed_version(path):
    for patch in table(path):
        assert patch.why and compat._TARGET.match(patch.target), patch.target
        upstream = _UPSTREAM.fullmatch(patch.upstream)
        assert upstream, (patch.target, patch.upstream)
        installed = importlib.metadata.version(upstream["distribution"])
        assert installed.startswith(upstream["series"] + ".") and upstream["read"].startswith(upstream["series"] + "."), (
            patch.target,
            installed,
            patch.upstream,
        )
        assert (patch.when == compat.ALWAYS) == (patch.only_if is None), patch.target  # a condition says when
        assert callable(patch.replacement) and (patch.only_if is None or callable(patch.only_if)), patch.target


def test_no_two_entries_change_the_same_attribute():
    every = targets(path for path, front_end in TABLES.items() if front_end in INSTALLED)
    assert len(every) == len(set(every))


def _fake_module(monkeypatch, **attrs):
    module = types.ModuleType("fake_upstream")
    vars(module).update(attrs)
    monkeypatch.setitem(sys.modules, "fake_upstream", module)
    return module


def wrapped(original):
    def replacement():
        return ("wrapped", original())

    return replacement


def test_an_attribute_upstream_no_longer_has_fails_by_name(monkeypatch):
    _fake_module(monkeypatch, renamed=lambda: 1)
    patch = compat.Patch("fake_upstream:gone", wrapped, "why", "fake 0.19.x")
    with pytest.raises(
        compat.UpstreamChanged,
        match=r"cannot patch fake_upstream:gone: fake_upstream\.gone does not "
        r"exist in the installed fake; .* written for fake 0\.19\.x",
    ):
        compat.apply((patch,))
    klass = type("Engine", (), {})
    _fake_module(monkeypatch, Engine=klass)
    with pytest.raises(compat.UpstreamChanged, match=r"Engine\.step does not exist"):
        compat.apply((compat.Patch("fake_upstream:Engine.step", wrapped, "why", "fake 0.19.x"),))


def test_a_function_that_no_longer_reads_a_rebound_name_fails_by_name(monkeypatch):
    def factory():
        return "stock"

    _fake_module(monkeypatch, factory=factory)
    patch = compat.Patch("fake_upstream:factory", wrapped, "why", "fake 0.19.x", rebinds=("Chained",))
    with pytest.raises(compat.UpstreamChanged, match=r"fake_upstream:factory: the function no longer reads Chained in the installed fake;"):
        compat.apply((patch,))


def test_a_replacement_applies_once_and_optional_modules_and_false_conditions_are_skipped(monkeypatch):
    module = _fake_module(monkeypatch, value=lambda: 1)
    patch = compat.Patch("fake_upstream:value", wrapped, "why", "fake 0.19.x")
    assert compat.apply((patch, patch)) == {"fake_upstream:value": True}
    assert module.value() == ("wrapped", 1) and compat.is_patched(module.value)
    missing = compat.Patch("not_installed_upstream:value", wrapped, "why", "fake 0.19.x", optional=True)
    assert compat.apply((missing,)) == {"not_installed_upstream:value": False}
    _fake_module(monkeypatch, other=lambda: 2)
    unmet = compat.Patch("fake_upstream:other", wrapped, "why", "fake 0.19.x", when="never", only_if=lambda current: False)
    assert compat.apply((unmet,)) == {"fake_upstream:other": False}
    compat.restore((patch,))


def test_rebound_leaves_the_module_alone():
    from megatron.core import optimizer as core_optimizer

    from dion3_megatron.megatron.registry import MEGATRON

    stock = (core_optimizer.HAVE_EMERGING_OPTIMIZERS, core_optimizer.ChainedOptimizer)
    factory = getattr(core_optimizer._get_megatron_emerging_optimizer, "__wrapped__", core_optimizer._get_megatron_emerging_optimizer)
    names = {
        "HAVE_EMERGING_OPTIMIZERS": "x",
        "LayerWiseDistributedOptimizer": "y",
        "ChainedOptimizer": "z",
        "_get_megatron_optimizer_based_on_param_groups": "w",
    }
    copy = compat.rebound(MEGATRON, "megatron.core.optimizer:_get_megatron_emerging_optimizer", factory, names)
    assert copy.__code__ is factory.__code__ and copy.__globals__["ChainedOptimizer"] == "z"
    assert (core_optimizer.HAVE_EMERGING_OPTIMIZERS, core_optimizer.ChainedOptimizer) == stock


def test_restore_removes_added_attributes_items_and_elements(monkeypatch):
    module = _fake_module(monkeypatch, value=lambda: 1, table={"kept": 1}, items=[0])
    original = module.value
    patches = (
        compat.Patch("fake_upstream:value", wrapped, "why", "fake 0.19.x"),
        compat.Patch("fake_upstream:added", wrapped, "why", "fake 0.19.x", adds=True),
        compat.Patch("fake_upstream:table['new']", wrapped, "why", "fake 0.19.x"),
        compat.Patch("fake_upstream:items[+]", wrapped, "why", "fake 0.19.x"),
    )
    compat.apply(patches)
    assert module.value() == ("wrapped", 1) and hasattr(module, "added") and "new" in module.table and len(module.items) == 2
    compat.restore(patches)
    assert module.value is original and not hasattr(module, "added")
    assert module.table == {"kept": 1} and module.items == [0]
    compat.apply(patches)
    assert compat.is_patched(module.value) and "new" in module.table
    compat.restore(patches)
