"""The foreach forms of Megatron's multi-tensor fallbacks (dion3_megatron.megatron.multi_tensor)
against Megatron's own local ones, on fresh random tensors of mixed sizes and dtypes."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core import utils  # noqa: E402

from dion3_megatron.megatron import multi_tensor  # noqa: E402


def _tensors(generator, dtype=torch.float32):
    shapes = [(37, 5), (128,), (3, 4, 5), (1,), (64, 64)]
    return [torch.randn(*s, generator=generator).to(dtype) * 10 ** torch.randint(-3, 3, (1,), generator=generator).item() for s in shapes]


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_l2_norm_equals_megatrons_loop(generator, device):
    tensors = [t.to(device) for t in _tensors(generator)]
    flag = torch.zeros(1, dtype=torch.int, device=device)
    ours, per = multi_tensor.foreach_l2_norm(0, flag, [tensors], True)
    theirs = torch.norm(torch.stack([torch.norm(t) for t in tensors]))  # local_multi_tensor_l2_norm's math
    assert ours.shape == (1,) and ours.dtype == torch.float32
    torch.testing.assert_close(ours[0], theirs, rtol=1e-6, atol=0)
    torch.testing.assert_close(per, torch.stack([torch.norm(t) for t in tensors]), rtol=1e-6, atol=0)
    assert multi_tensor.foreach_l2_norm(0, flag, [[]], False)[0].tolist() == [0.0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale", [1.0, 0.37])
@pytest.mark.parametrize("dst_dtype", [torch.float32, torch.bfloat16])
def test_scale_and_copy_are_bit_identical_to_megatrons_loop(generator, scale, dst_dtype, device):
    src = [t.to(device) for t in _tensors(generator)]
    ours = [torch.full_like(t, float("nan"), dtype=dst_dtype) for t in src]
    theirs = [torch.full_like(t, float("nan"), dtype=dst_dtype) for t in src]
    multi_tensor.foreach_scale(0, None, [src, ours], scale)
    utils.local_multi_tensor_scale(0, None, [src, theirs], scale)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    in_place, reference = [t.clone() for t in src], [t.clone() for t in src]
    multi_tensor.foreach_scale(0, None, [in_place, in_place], scale)  # clipping scales the grads in place
    utils.local_multi_tensor_scale(0, None, [reference, reference], scale)
    assert all(torch.equal(a, b) for a, b in zip(in_place, reference))


@pytest.mark.slow
def test_registration_installs_them_for_dion3_steps_where_megatron_has_only_its_loops():
    """Outside a step of Dion3's wrappers (every other optimizer's run) Megatron's own loops run."""
    check = textwrap.dedent("""
        import torch
        from megatron.core import utils
        from megatron.core.optimizer import clip_grads, optimizer
        import dion3_megatron.megatron
        from dion3_megatron import compat
        from dion3_megatron.megatron import multi_tensor as mt
        replaced = [clip_grads.l2_norm_impl, clip_grads.multi_tensor_scale_impl, optimizer.multi_tensor_scale_impl]
        originals = [utils.local_multi_tensor_l2_norm, utils.local_multi_tensor_scale, utils.local_multi_tensor_scale]
        calls = []
        foreach_mul = torch._foreach_mul
        torch._foreach_mul = lambda *a, **k: calls.append(1) or foreach_mul(*a, **k)
        src = [torch.randn(5, 3), torch.randn(7)]
        outside, inside = [torch.empty_like(t) for t in src], [torch.empty_like(t) for t in src]
        clip_grads.multi_tensor_scale_impl(0, None, [src, outside], 0.37)
        stock_calls = len(calls)
        with mt.dion3_step():
            clip_grads.multi_tensor_scale_impl(0, None, [src, inside], 0.37)
        print(all(compat.is_patched(r) and r.__wrapped__ is o for r, o in zip(replaced, originals)),
              stock_calls == 0, len(calls) == 1, all(torch.equal(a, b) for a, b in zip(outside, inside)),
              compat.apply(dion3_megatron.megatron.registry.MEGATRON)["megatron.core.optimizer.clip_grads:l2_norm_impl"])
    """)
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["True"] * 5, out.stdout
