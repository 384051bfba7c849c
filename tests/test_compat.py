"""dion3_megatron.compat: the list of every Megatron and DeepSpeed attribute the package changes is
complete (registration changes nothing else), applying it twice changes nothing, and an attribute
upstream no longer has fails by name."""

from __future__ import annotations

import importlib.util
import json
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

# In a fresh interpreter: import every module the entries touch and every module of the package
# (with registration held back), note every attribute of every Megatron, DeepSpeed and
# torch.optim module (and of the classes, dict items and list elements they hold), register for
# both frameworks (the launcher's entry too), note again, register again, note again.
_SCRIPT = textwrap.dedent("""
    import importlib, json, os, sys, types
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from dion3_megatron import compat

    apply = compat.apply
    compat.apply = lambda patches, launcher=False: {p.target: False for p in patches}  # held back
    for patch in compat.MEGATRON + compat.DEEPSPEED:
        importlib.import_module(patch.target.split(":")[0])
    import dion3_megatron.megatron, dion3_megatron.deepspeed
    compat.apply = apply

    # A dict or list can be reachable from several modules (megatron.core.optimizer re-exports
    # _EMERGING_OPTIMIZERS): note it under the name its entry uses.
    named = {}
    for patch in compat.MEGATRON + compat.DEEPSPEED:
        module, _, path = patch.target.partition(":")
        if "[" in path:
            named[id(getattr(sys.modules[module], path.split("[")[0]))] = f"{module}:{path.split('[')[0]}"

    def ours(value):
        return (getattr(value, "__module__", None) or "").startswith("dion3_megatron")

    def note():
        seen, held = {}, set()
        for name, module in list(sys.modules.items()):
            if module is None or not (name.split(".")[0] in ("megatron", "deepspeed") or name == "torch.optim"):
                continue
            for attr, value in list(vars(module).items()):
                if attr.startswith("__") or isinstance(value, types.ModuleType):
                    continue
                where = f"{name}:{attr}"
                seen[where] = id(value)
                held |= {where} if ours(value) else set()
                if isinstance(value, type) and value.__module__ == name:
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

    before, _ = note()
    modules = {k.split(":")[0] for k in before}
    megatron_lm = dion3_megatron.megatron.register(launcher=True)
    dion3_megatron.deepspeed.register()
    after, held = note()
    applied = {**compat.apply_megatron(launcher=True), **compat.apply_deepspeed()}
    dion3_megatron.megatron.register(launcher=True)
    dion3_megatron.deepspeed.register()
    again, _ = note()
    changed = sorted(k for k in after if k in before and after[k] != before[k]) + sorted(
        k for k in set(after) - set(before) if k.split(":")[0] in modules)  # (not what a new module holds)
    print("RESULT" + json.dumps(dict(changed=changed, held=sorted(held), applied=applied, megatron_lm=megatron_lm,
                                     same=again == after,
                                     differ=sorted(k for k in set(again) | set(after) if again.get(k) != after.get(k)))))
""")


@pytest.fixture(scope="module")
def registered():
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    (line,) = [line for line in out.stdout.splitlines() if line.startswith("RESULT")]
    return json.loads(line[len("RESULT") :])


@pytest.mark.slow
def test_every_changed_attribute_is_listed_and_every_listed_one_applies_here(registered):
    listed = {p.target for p in compat.MEGATRON + compat.DEEPSPEED}
    changed, held = set(registered["changed"]), set(registered["held"])
    assert changed - listed == set(), "changed by registration but not in dion3_megatron/compat.py"
    assert held - listed == set(), "holding the package's objects but not in dion3_megatron/compat.py"
    # No apex or Transformer Engine here, the dataset helpers come compiled: every entry applies.
    assert registered["applied"] == {target: True for target in registered["applied"]}
    assert set(registered["applied"]) == listed
    assert changed == listed and registered["megatron_lm"] is True


@pytest.mark.slow
def test_applying_twice_changes_nothing(registered):
    assert registered["same"], registered["differ"]


def test_entries_are_complete_and_resolve():
    targets = [p.target for p in compat.MEGATRON + compat.DEEPSPEED]
    assert len(targets) == len(set(targets))
    for patch in compat.MEGATRON + compat.DEEPSPEED:
        assert patch.why and patch.upstream.split(" ")[1].startswith("0.19"), patch.target
        assert patch.when in (compat.ALWAYS, compat.WITHOUT_APEX_OR_TE, compat.LAUNCHER), patch.target
        assert (patch.when == compat.WITHOUT_APEX_OR_TE) <= (patch.only_if is not None), patch.target
        assert callable(compat._resolve(patch.replacement)), patch.target
        assert patch.only_if is None or callable(compat._resolve(patch.only_if)), patch.target
        assert compat._TARGET.match(patch.target), patch.target


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
    patch = compat.Patch("fake_upstream:gone", f"{__name__}:wrapped", "why", "fake 0.19.x")
    with pytest.raises(
        compat.UpstreamChanged,
        match=r"cannot patch fake_upstream:gone: fake_upstream\.gone does not "
        r"exist in the installed fake; .* written for fake 0\.19\.x",
    ):
        compat.apply((patch,))
    klass = type("Engine", (), {})
    _fake_module(monkeypatch, Engine=klass)
    with pytest.raises(compat.UpstreamChanged, match=r"Engine\.step does not exist"):
        compat.apply((compat.Patch("fake_upstream:Engine.step", f"{__name__}:wrapped", "why", "fake 0.19.x"),))


def test_a_function_that_no_longer_reads_a_rebound_name_fails_by_name(monkeypatch):
    def factory():
        return "stock"

    _fake_module(monkeypatch, factory=factory)
    patch = compat.Patch("fake_upstream:factory", f"{__name__}:wrapped", "why", "fake 0.19.x", rebinds=("Chained",))
    with pytest.raises(compat.UpstreamChanged, match=r"fake_upstream:factory: the function no longer reads Chained in the installed fake;"):
        compat.apply((patch,))


def test_a_replacement_applies_once_and_optional_modules_are_skipped(monkeypatch):
    module = _fake_module(monkeypatch, value=lambda: 1)
    patch = compat.Patch("fake_upstream:value", f"{__name__}:wrapped", "why", "fake 0.19.x")
    assert compat.apply((patch, patch)) == {"fake_upstream:value": True}
    assert module.value() == ("wrapped", 1) and compat.is_patched(module.value)
    missing = compat.Patch("not_installed_upstream:value", f"{__name__}:wrapped", "why", "fake 0.19.x", optional=True)
    assert compat.apply((missing,)) == {"not_installed_upstream:value": False}
    launcher = compat.Patch("fake_upstream:value", f"{__name__}:wrapped", "why", "fake 0.19.x", when=compat.LAUNCHER)
    assert compat.apply((launcher,)) == {"fake_upstream:value": False}


def test_rebound_leaves_the_module_alone():
    from megatron.core import optimizer as core_optimizer

    stock = (core_optimizer.HAVE_EMERGING_OPTIMIZERS, core_optimizer.ChainedOptimizer)
    factory = getattr(core_optimizer._get_megatron_emerging_optimizer, "__wrapped__", core_optimizer._get_megatron_emerging_optimizer)
    names = {"HAVE_EMERGING_OPTIMIZERS": "x", "LayerWiseDistributedOptimizer": "y", "ChainedOptimizer": "z"}
    copy = compat.rebound("megatron.core.optimizer:_get_megatron_emerging_optimizer", factory, names)
    assert copy.__code__ is factory.__code__ and copy.__globals__["ChainedOptimizer"] == "z"
    assert (core_optimizer.HAVE_EMERGING_OPTIMIZERS, core_optimizer.ChainedOptimizer) == stock


# In a fresh interpreter: note what every entry's target holds (with registration held back),
# register both frameworks, unregister both, register again.
_UNREGISTER = textwrap.dedent("""
    import importlib, json, os
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from dion3_megatron import compat

    apply = compat.apply
    compat.apply = lambda patches, launcher=False: {p.target: False for p in patches}  # held back
    import dion3_megatron.megatron as dm, dion3_megatron.deepspeed as dd
    compat.apply = apply
    patches = compat.MEGATRON + compat.DEEPSPEED

    def held(patch):
        owner, name, key = compat._locate(patch)
        if key is None:  # the raw attribute, absent where inherited or new
            return vars(owner).get(name, "absent")
        container = getattr(owner, name)
        return list(container) if key == "+" else container.get(key, "absent")

    def same(a, b):
        if isinstance(a, list):
            return isinstance(b, list) and len(a) == len(b) and all(x is y for x, y in zip(a, b))
        return a is b

    originals = {p.target: held(p) for p in patches}
    dm.register(launcher=True), dd.register()
    changed = [p.target for p in patches if not same(held(p), originals[p.target])]
    dm.unregister(), dd.unregister()
    restored = [p.target for p in patches if same(held(p), originals[p.target])]
    unregistered = not dm.is_registered() and not hasattr(__import__("torch").optim, "Dion3")
    again = {**compat.apply_megatron(launcher=True), **compat.apply_deepspeed()}
    print("RESULT" + json.dumps(dict(targets=[p.target for p in patches], changed=changed, restored=restored,
                                     unregistered=unregistered, again=again, registered_again=dm.is_registered())))
""")


@pytest.mark.slow
def test_unregister_restores_every_original_and_register_works_again():
    out = subprocess.run([sys.executable, "-c", _UNREGISTER], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    (line,) = [line for line in out.stdout.splitlines() if line.startswith("RESULT")]
    result = json.loads(line[len("RESULT") :])
    targets = result["targets"]
    assert result["changed"] == targets  # every entry applies here (see above) ...
    assert result["restored"] == targets  # ... and is the original again
    assert result["unregistered"]
    assert result["again"] == {target: True for target in targets} and result["registered_again"]


def test_restore_removes_added_attributes_items_and_elements(monkeypatch):
    module = _fake_module(monkeypatch, value=lambda: 1, table={"kept": 1}, items=[0])
    original = module.value
    patches = (
        compat.Patch("fake_upstream:value", f"{__name__}:wrapped", "why", "fake 0.19.x"),
        compat.Patch("fake_upstream:added", f"{__name__}:wrapped", "why", "fake 0.19.x", adds=True),
        compat.Patch("fake_upstream:table['new']", f"{__name__}:wrapped", "why", "fake 0.19.x"),
        compat.Patch("fake_upstream:items[+]", f"{__name__}:wrapped", "why", "fake 0.19.x"),
    )
    compat.apply(patches)
    assert module.value() == ("wrapped", 1) and hasattr(module, "added") and "new" in module.table and len(module.items) == 2
    compat.restore(patches)
    assert module.value is original and not hasattr(module, "added")
    assert module.table == {"kept": 1} and module.items == [0]
    compat.apply(patches)
    assert compat.is_patched(module.value) and "new" in module.table
    compat.restore(patches)
