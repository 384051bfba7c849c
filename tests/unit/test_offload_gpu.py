"""Offloaded state on a GPU (dion3_megatron/engine/offload.py): pinned host state streamed to the GPU
on side streams, one shape group at a time. The offloaded step equals the step without offload bit
for bit (torch Dion3 on GPU parameters, on host parameters, and DeepSpeed ZeRO 1-3 with
``offload_optimizer``), the state lives in pinned host memory, and the GPU holds none of it between
steps. The same code on the CPU, every copy included: tests/unit/test_offload.py."""

from __future__ import annotations

import importlib
import importlib.util
import os

import pytest
import torch

from dion3_megatron import Dion3

pytestmark = pytest.mark.gpu

# Three shape groups; 4096 rows make the momentum of the biggest group 64 MiB.
SHAPES = [(1024, 4096)] * 3 + [(4096, 1024)] * 2 + [(512, 512)] * 4


def params_on(device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.02).to(device)) for s in SHAPES]


def step(params, opt, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.device)
        opt.step()
    torch.cuda.synchronize()


@pytest.mark.parametrize("fraction,momentum_dtype", [(0.25, "fp32"), (1.0, "fp32"), (0.25, "bf16")])
def test_an_offloaded_dion3_step_on_a_gpu_equals_the_step_without_bit_for_bit(fraction, momentum_dtype):
    """The step without offload replays a CUDA graph from its third step (graph == eager bit for
    bit); the offloaded one runs eagerly, group by group: the same kernels on the same numbers. A
    bf16 momentum's count of steps travels with it."""
    plain, offloaded = params_on("cuda"), params_on("cuda")
    opt = Dion3(plain, fraction=fraction, momentum_dtype=momentum_dtype)
    opt_offloaded = Dion3(offloaded, fraction=fraction, momentum_dtype=momentum_dtype, offload=True)
    step(plain, opt, 5)
    step(offloaded, opt_offloaded, 5)
    assert opt_offloaded._whole.session.engine.offload == torch.device("cuda", torch.cuda.current_device())
    for a, b in zip(plain, offloaded):
        assert torch.equal(a, b)
    for a, b in zip(plain, offloaded):
        for key, value in opt.state[a].items():
            held = opt_offloaded.state[b][key]
            assert held.device.type == "cpu" and held.is_pinned(), key
            assert torch.equal(value.cpu(), held), key


def test_a_resume_loads_the_offloaded_state_into_host_memory_and_continues_bit_for_bit():
    params, resumed = params_on("cuda"), params_on("cuda", seed=3)
    opt = Dion3(params, fraction=0.25, offload=True)
    step(params, opt, 3)
    saved = opt.state_dict()
    for p, q in zip(params, resumed):
        q.data.copy_(p.data)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    opt_resumed = Dion3(resumed, fraction=0.25, offload=True)
    opt_resumed.load_state_dict(saved)
    assert torch.cuda.memory_allocated() - before < 0.02 * sum(p.numel() * 4 for p in params)
    assert all(opt_resumed.state[q]["momentum"].device.type == "cpu" for q in resumed)
    step(params, opt, 2, seed=4)
    step(resumed, opt_resumed, 2, seed=4)
    for a, b in zip(params, resumed):
        assert torch.equal(a, b)


def test_host_parameters_stream_to_the_gpu_and_step_as_there():
    """Parameters and gradients in host memory (as DeepSpeed's ZeRO-Offload keeps its partitions):
    each group's pieces travel with its state, step on the GPU and come back."""
    on_gpu, on_host = params_on("cuda"), params_on("cpu")
    opt, opt_host = Dion3(on_gpu, fraction=0.25, cuda_graph=False), Dion3(on_host, fraction=0.25, offload=True)
    step(on_gpu, opt, 3)
    step(on_host, opt_host, 3)
    assert opt_host._whole.session.engine.offload.type == "cuda"
    for a, b in zip(on_gpu, on_host):
        assert b.device.type == "cpu" and torch.equal(a.cpu(), b)


# Ten shape groups of two matrices (the largest 16% of the state): enough groups that two of them
# are a small part of the whole.
MANY = [(768, 768 + 256 * i) for i in range(10) for _ in range(2)]


def test_the_gpu_holds_no_offloaded_state_between_steps_and_about_two_groups_during_one():
    gen = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).cuda() * 0.02) for s in MANY]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).cuda()
    state_bytes = sum(p.numel() * 4 for p in params)  # the momentum alone

    def growth(opt) -> int:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        for _ in range(3):
            opt.step()
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated() - before

    assert growth(Dion3(params, fraction=0.25, offload=True)) < 0.02 * state_bytes
    assert growth(Dion3(params, fraction=0.25)) >= state_bytes  # (the measure sees state where it is)
    opt = Dion3(params, fraction=0.25, offload=True)
    opt.step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    opt.step()
    torch.cuda.synchronize()
    # two buffers of the largest group's state (a third of it all here), and the step's temporaries
    assert torch.cuda.max_memory_allocated() - before < 0.6 * state_bytes


def _deepspeed_offloads(rank, world, cases):
    """For each (ZeRO stage, momentum dtype) of ``cases``: the run in fp32 on one GPU with and
    without offload_optimizer to the CPU; (the parameters' largest difference, the offloaded
    engine's device, whether its state is in pinned host memory)."""
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    import deepspeed

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    import dion3_megatron.deepspeed as dion3_ds
    from support import deepspeed_helpers as h
    from support.deepspeed_offload import offloaded, stage_config
    from support.deepspeed_zero3 import Zero3Net

    deepspeed.init_distributed(dist_backend="nccl")

    def run(stage: int, momentum_dtype: str, offload: bool):
        cfg = stage_config(stage, 1, ns_dtype="float32", momentum_dtype=momentum_dtype)
        torch.manual_seed(0)
        model = (Zero3Net if stage == 3 else h.Net)().cuda()
        params = model.parameters() if stage == 3 else dion3_ds.param_groups(model)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=offloaded(cfg) if offload else cfg)
        gen = torch.Generator().manual_seed(5)
        for _ in range(3):
            tokens = torch.randint(0, h.VOCAB, (h.GLOBAL_BATCH, h.SEQ), generator=gen).cuda()
            engine.backward(engine(tokens))
            engine.step()
        opt = h._basic(engine)
        state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
            params = {n: p.detach().float().cpu() for n, p in engine.module.named_parameters()}
        return params, opt._session.engine.offload, bool(state) and all(v.device.type == "cpu" and v.is_pinned() for v in state)

    out = []
    for stage, momentum_dtype in cases:
        plain, _, _ = run(stage, momentum_dtype, False)
        offloaded_params, device, pinned = run(stage, momentum_dtype, True)
        out.append((h.max_diff(plain, offloaded_params), str(device), pinned))
    return out


DEEPSPEED_CASES = [(1, "fp32"), (2, "fp32"), (3, "fp32"), (2, "bf16"), (3, "bf16")]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
def test_deepspeed_offload_optimizer_at_zero_1_to_3_equals_the_run_without():
    """ZeRO 1, 2 and 3, the momentum in fp32 and in bf16: ``offload_optimizer`` to the CPU keeps
    Dion3's state in pinned host memory, streams it through the GPU, and trains as without it."""
    from support.dist_utils import run_distributed

    (outs,) = run_distributed(_deepspeed_offloads, 1, DEEPSPEED_CASES, backend="nccl", timeout=600)
    for (stage, momentum_dtype), (diff, device, pinned) in zip(DEEPSPEED_CASES, outs):
        assert device.startswith("cuda") and pinned, (stage, momentum_dtype, device, pinned)
        assert diff <= 1e-6, (stage, momentum_dtype, diff)  # (DeepSpeed's ZeRO-Offload averages the gradients on the host)
