"""The Triton row kernels against the torch forms of rule.apply_rows, rule.take_selected and
rule.accumulate_and_score.

On CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, in a subprocess: the flag is
read when triton is imported); on a GPU it runs compiled.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from support.repository import ROOT

from dion3_megatron.core import rule
from dion3_megatron.kernels import rows as row_kernels

# Fresh random weights (row views of a wider buffer), distinct selected rows, steps and scales:
# the kernel's result against a float64 reference of decay * W + scale * step, the unselected rows
# against decay * W exactly as torch rounds it, and the columns outside the views untouched.
CHECK = textwrap.dedent("""
    import torch
    from dion3_megatron.kernels.triton_rows import accumulate_and_score, apply_rows, dense_matrices, normalized, take_selected

    def check(device, seed):
        # Triton's interpreter rounds fp32 -> bf16 toward zero (compiled kernels round to nearest
        # even, as torch does): half-precision results are compared to within that rounding there.
        compiled = device != "cpu"
        gen = torch.Generator().manual_seed(seed)
        for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2 ** -8 if compiled else 2 ** -7)):
            batch, n, c, k = 3, 37, 150, 9
            wide = torch.randn(batch, n, c + 10, generator=gen).to(dtype).to(device)
            wide_before = wide.clone()
            weights = [wide[b, :, 3:3 + c] for b in range(batch)]  # row stride c + 10
            rows = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(batch)]).to(device)
            steps = torch.randn(batch, k, c, generator=gen).to(device)
            scale = torch.rand(batch, k, generator=gen).to(device) - 0.5
            decay = torch.tensor([0.99, 0.9, 1.0]).to(device)
            apply_rows(weights, rows, steps, scale, decay)
            for b, w in enumerate(weights):
                before = wide_before[b, :, 3:3 + c]
                ref = before.double() * decay[b].double()
                ref[rows[b]] += scale[b].double().unsqueeze(-1) * steps[b].double()
                err = ((w.double() - ref).abs().max() / ref.abs().max()).item()
                assert err <= tol, (dtype, b, err)
                others = torch.ones(n, dtype=torch.bool, device=device)
                others[rows[b]] = False
                if dtype == torch.float32:  # the torch form, bit for bit (no contraction)
                    torch_form = (before * decay[b]).index_add_(0, rows[b], steps[b] * scale[b].unsqueeze(-1))
                    assert torch.equal(w, torch_form), b
                if compiled or dtype == torch.float32:  # decay * W in fp32, rounded once to the dtype
                    plain = (before.float() * decay[b]).to(dtype)
                    assert torch.equal(w[others], plain[others]), (dtype, b)
            assert torch.equal(wide[:, :, :3], wide_before[:, :, :3])
            assert torch.equal(wide[:, :, 3 + c:], wide_before[:, :, 3 + c:])
        # rows equal to n (held by another rank) are skipped, however many there are
        n, c, k = 21, 40, 6
        w = torch.randn(n, c, generator=gen).to(device)
        before = w.clone()
        rows = torch.tensor([[3, n, 7, n, n, 0]]).to(device)
        steps = torch.randn(1, k, c, generator=gen).to(device)
        apply_rows([w], rows, steps, torch.ones(1, k).to(device), [0.5])
        ref = before * 0.5
        for i, r in enumerate(rows[0].tolist()):
            if r < n:
                ref[r] += steps[0, i]
        assert torch.allclose(w, ref, atol=1e-6)
        # half-precision steps (Newton-Schulz's fp16 result, as it comes) are read as fp32: the same
        # update, bit for bit, as from their fp32 copy
        batch, n, c, k = 2, 19, 70, 5
        half_w = torch.randn(batch, n, c, generator=gen).to(device)
        full_w = half_w.clone()
        rows = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(batch)]).to(device)
        steps = torch.randn(batch, k, c, generator=gen).to(torch.float16).to(device)
        scale = torch.rand(batch, k, generator=gen).to(device)
        apply_rows(list(half_w.unbind(0)), rows, steps, scale, [0.99, 0.9])
        apply_rows(list(full_w.unbind(0)), rows, steps.float(), scale, [0.99, 0.9])
        assert torch.equal(half_w, full_w)
        # take_selected: rows copied out exactly, decayed in place by mu (a number or one per matrix);
        # rows held elsewhere point at the padded zero row, more than once
        batch, n, c, k = 3, 29, 140, 8
        for mu in (0.9, torch.tensor([0.9, 0.5, 1.0]).to(device)):
            padded = torch.randn(batch, n + 1, c, generator=gen).to(device)
            padded[:, n] = 0
            idx = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(batch)])
            idx[:, :2] = n  # two rows held by another rank
            idx = idx.to(device)
            before = padded.clone()
            out = take_selected(padded, idx, mu)
            expected = torch.stack([before[b, idx[b]] for b in range(batch)])
            assert torch.equal(out, expected)
            factor = mu if isinstance(mu, float) else mu.view(-1, 1)
            for b in range(batch):
                f = factor if isinstance(factor, float) else factor[b]
                want = before[b].clone()
                want[idx[b]] = before[b, idx[b]] * f
                assert torch.equal(padded[b], want), b
            assert torch.equal(padded[:, n], torch.zeros_like(padded[:, n]))
        # accumulate_and_score: momentum += grad as torch adds it (a bf16 gradient upcast first), the L1 norm
        # of every new row to within fp32 rounding (more than one column block); the columns outside
        # the momentum's views untouched
        batch, n, c = 2, 13, 1100
        for grad_dtype, decay in ((torch.float32, None), (torch.bfloat16, None), (torch.float32, 0.9)):
            wide = torch.randn(batch, n, c + 6, generator=gen).to(device)
            wide_before = wide.clone()
            momentum = wide[:, :, 2:2 + c]
            grads = [torch.randn(n, c, generator=gen).to(grad_dtype).to(device) for _ in range(batch)]
            out = torch.full((batch, n), float("nan")).to(device)
            accumulate_and_score(momentum, grads, out, decay)
            want = wide_before[:, :, 2:2 + c] + torch.stack(grads).float()
            assert torch.equal(momentum, want if decay is None else want * decay), grad_dtype  # the scores: before it
            assert torch.allclose(out, want.double().abs().sum(-1).float(), rtol=1e-5, atol=0), grad_dtype
            assert torch.equal(wide[:, :, :2], wide_before[:, :, :2])
            assert torch.equal(wide[:, :, 2 + c:], wide_before[:, :, 2 + c:])
        # normalized: x / (f ||x||_F + eps) per matrix against float64, written in half precision in
        # x's layout (row-major, and a tall matrix's transposed view); a zero matrix stays zero, and
        # entries near fp32's largest (whose squares overflow) give the same result as small ones
        for dtype, rel in ((torch.float16, 2 ** -10), (torch.bfloat16, 2 ** -7)):
            for layout in ("rows", "columns"):
                raw = torch.randn(3, 20, 300, generator=gen) if layout == "rows" else torch.randn(3, 300, 20, generator=gen).mT
                x = raw.to(device)
                x[1] *= 1e36
                x[2] = 0
                assert dense_matrices(x)
                out = normalized(x, dtype, 1.05, 1e-7)
                assert out.dtype == dtype and out.stride() == x.stride()
                wide = x.double()
                ref = wide / (1.05 * wide.flatten(1).norm(dim=1).view(-1, 1, 1) + 1e-7)
                err = (out.double() - ref).abs() - rel * ref.abs()
                assert err.max().item() <= 2 ** -24, (dtype, layout, err.max().item())
                assert torch.equal(out[2], torch.zeros_like(out[2]))
        assert not dense_matrices(torch.randn(2, 20, 300)[:, :, :100])
        if device == "cuda":  # more blocks per matrix than one step of the program between the passes takes
            x = torch.randn(2, 1536, 2048, generator=gen).to(device)
            x[1] *= 1e30  # whose squares overflow fp32
            out = normalized(x, torch.float16, 1.0, 1e-7)
            ref = x.double() / (x.double().flatten(1).norm(dim=1).view(-1, 1, 1) + 1e-7)
            assert ((out.double() - ref).abs() - 2 ** -10 * ref.abs()).max().item() <= 2 ** -24
            # more blocks than a CUDA grid's second axis takes (65535), as a 64k-vocabulary matrix has
            x = torch.randn(1, 16384, 8448, generator=gen).to(device)
            out = normalized(x, torch.bfloat16, 1.0, 1e-7)
            ref = x.double() / (x.double().norm() + 1e-7)
            assert ((out.double() - ref).abs() - 2 ** -7 * ref.abs()).max().item() <= 2 ** -24
""")


@pytest.mark.slow
def test_kernel_under_the_triton_interpreter_on_cpu():
    pytest.importorskip("triton")
    seed = torch.seed() % 2**31
    script = CHECK + f"check('cpu', {seed})\nprint('ok')\n"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"seed={seed}\n{out.stderr[-3000:]}"
    assert out.stdout.strip().endswith("ok")


@pytest.mark.gpu
def test_kernel_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("triton")
    namespace: dict = {}
    exec(CHECK, namespace)
    namespace["check"]("cuda", torch.seed() % 2**31)
    assert row_kernels.runs_on(torch.device("cuda", torch.cuda.current_device()))  # the probe builds them here


@pytest.mark.gpu
def test_kernel_on_a_gpu_other_than_the_current_one():
    """One process, matrices on its second GPU: the kernels launch there, not on the current one."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    pytest.importorskip("triton")
    namespace: dict = {}
    exec(CHECK, namespace)
    with torch.cuda.device(0):
        namespace["check"]("cuda:1", torch.seed() % 2**31)
        assert row_kernels.runs_on(torch.device("cuda", 1))
        assert torch.cuda.current_device() == 0


def test_row_kernels_that_cannot_be_built_leave_the_torch_forms_with_a_warning(monkeypatch):
    """Triton needs a C compiler on first use: where the kernels cannot be built, the rule keeps
    its torch forms (same results) and warns, instead of failing the step."""
    pytest.importorskip("triton")
    from dion3_megatron.kernels import triton_rows

    def no_compiler(device):
        raise RuntimeError("Failed to find C compiler")

    monkeypatch.setattr(triton_rows, "probe", no_compiler)
    with pytest.warns(RuntimeWarning, match="torch forms"):
        assert not row_kernels.runs_on.__wrapped__(torch.device("cpu"))
    monkeypatch.setattr(triton_rows, "probe", lambda device: None)
    assert row_kernels.runs_on.__wrapped__(torch.device("cpu"))


def test_row_scales_are_normuon(generator):
    """normalize_rows from per-row multipliers equals NorMuon written out block by block."""
    ortho = torch.randn(4, 12, 40, generator=generator, dtype=torch.float64)
    variance = torch.rand(4, 12, generator=generator, dtype=torch.float64)
    beta2, eps = 0.95, 1e-8
    v = variance * beta2 + ortho.square().mean(dim=-1) * (1 - beta2)
    normalized = ortho / (v.sqrt() + eps).unsqueeze(-1)
    factor = torch.linalg.matrix_norm(ortho, keepdim=True) / torch.linalg.matrix_norm(normalized, keepdim=True)
    expected = normalized * factor * 0.7
    got, got_v = rule.normalize_rows(ortho, variance, beta2, eps, 0.7)
    assert torch.allclose(got_v, v, rtol=1e-12, atol=0)
    assert torch.allclose(got, expected, rtol=1e-10, atol=1e-14)


def test_apply_rows_on_cpu_is_shrink_then_index_add(generator):
    weights = torch.randn(2, 10, 6, generator=generator)
    rows = torch.tensor([[1, 4, 7], [0, 2, 9]])
    steps = torch.randn(2, 3, 6, generator=generator)
    scale = torch.rand(2, 3, generator=generator)
    expected = weights.clone() * torch.tensor([0.9, 0.8]).view(2, 1, 1)
    for b in range(2):
        expected[b].index_add_(0, rows[b], steps[b] * scale[b].unsqueeze(-1))
    w = weights.clone()
    rule.apply_rows(list(w.unbind(0)), rows, steps, scale, [0.9, 0.8])
    assert torch.allclose(w, expected, atol=1e-7)


# End to end on CPU: the same steps with the rule's torch forms and with the row kernels (forced on
# for CPU tensors, run by Triton's interpreter) give the same bits: contraction is off, so the
# kernels round exactly as the torch forms do.


def force_row_kernels() -> None:
    """Route the rule through the row kernels for any tensors, CPU ones included (the interpreter)."""
    row_kernels.takes = lambda weights: len(weights) > 0


SINGLE_PROCESS = textwrap.dedent("""
    import torch
    from dion3_megatron import Dion3
    from unit.test_fused_rows import force_row_kernels

    def run(seed, fused):
        if fused:
            force_row_kernels()
        gen = torch.Generator().manual_seed(seed)
        shapes = [(24, 40)] * 3 + [(40, 24)] * 2 + [(64, 96)]
        params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
        grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(3)]
        groups = [{"params": params[:4], "lr": 0.02}, {"params": params[4:], "lr": 0.05, "mu": 0.8}]
        opt = Dion3(groups, fraction=0.25, weight_decay=0.1, ns_dtype=torch.float32, cuda_graph=False)
        for step in range(3):
            for p, g in zip(params, grads[step]):
                p.grad = g
            opt.step()
        state = [opt.state[p] for p in params]
        return [p.detach() for p in params] + [s["momentum"] for s in state] + [s["variance"] for s in state]
""")


@pytest.mark.slow
def test_optimizer_steps_with_row_kernels_equal_the_torch_forms_bit_for_bit():
    pytest.importorskip("triton")
    seed = torch.seed() % 2**31
    script = SINGLE_PROCESS + textwrap.dedent(f"""
        torch_form, kernels = run({seed}, False), run({seed}, True)
        assert all(torch.equal(a, b) for a, b in zip(torch_form, kernels)), "differ"
        assert not torch.equal(torch_form[0], torch.randn(1))  # (the run did something)
        print("ok")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"seed={seed}\n{out.stderr[-3000:]}"


def static_exchange_with_row_kernels(rank, world, fused, seed):
    """Row and column blocks on the static exchange (row blocks skip rows another rank holds)."""
    if fused:
        force_row_kernels()
    from integration.test_megabatch import static_exchange_worker

    return static_exchange_worker(rank, world, "rowscols", 0.25, seed)[0]


@pytest.mark.slow
def test_static_exchange_with_row_kernels_equals_the_torch_forms_bit_for_bit(monkeypatch):
    pytest.importorskip("triton")
    from support.dist_utils import run_distributed

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read by triton when the spawned ranks import it
    seed = torch.seed() % 2**31
    torch_form = run_distributed(static_exchange_with_row_kernels, 2, False, seed)
    kernels = run_distributed(static_exchange_with_row_kernels, 2, True, seed)
    for rank in range(2):
        assert all(torch.equal(a, b) for a, b in zip(torch_form[rank], kernels[rank])), f"seed={seed} rank={rank}"
