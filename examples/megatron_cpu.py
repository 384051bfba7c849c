"""Run Megatron-Core on CPU (gloo) for demos and tests.

Megatron-Core hard-codes CUDA in places that have nothing to do with the math: ``device='cuda'``
buffers, ``torch.cuda.current_device()``, streams and events, the CUDA RNG tracker, and
``param.type()`` strings such as ``'torch.cuda.FloatTensor'``. :func:`install` redirects all of that
to the CPU inside the current process, so that GPTModel (local layer spec), DDP, the distributed
and layer-wise distributed optimizers, tensor/pipeline/expert parallelism and torch_dist
checkpoints run over gloo on CPU processes. ``examples/pretrain_gpt.py`` (on CPU) and the
Megatron tests use it.

It patches ``torch`` and ``torch.cuda`` process-wide (and starts Megatron's checkpoint writer's
helper process by fork) and cannot be undone: call it only in a process that will never use a GPU,
before building any Megatron object. fp32 is the CPU dtype
(bf16 works but is slow on CPU); apex, Transformer Engine and sequence parallelism are not
available.

Megatron-LM's training loop too: :func:`allow_pretrain` lets ``megatron.training.pretrain()`` start
without CUDA, and run as a script this module runs a Megatron-LM training script on CPU ranks
through ``dion3_megatron.megatron.launch`` (so ``--optimizer dion3`` is registered)::

    torchrun --standalone --nproc-per-node 2 examples/megatron_cpu.py \\
        examples/megatron_lm_pretrain_gpt.py --optimizer dion3 --use-distributed-optimizer ...

(``--distributed-backend gloo`` is added when the arguments do not name a backend.)
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import types
import warnings

import torch

_installed = False
_CPU = torch.device("cpu")


def _fix_device(device):
    if device is None:
        return None
    if isinstance(device, int):
        return _CPU
    if isinstance(device, str):
        return _CPU if device.startswith("cuda") else device
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


def _wrap_factory(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _fix_device(kwargs["device"])
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    return wrapper


class _Stream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, event=None):
        return event or _Event()

    def synchronize(self):
        pass

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Event:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


def install() -> None:
    """Patch torch and Megatron-Core so their CUDA-only code paths run on the CPU. Idempotent."""
    global _installed
    if _installed:
        return
    _installed = True
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|apex|absl|transformer-engine).*")

    for name in (
        "empty",
        "zeros",
        "ones",
        "full",
        "arange",
        "tensor",
        "rand",
        "randn",
        "randint",
        "empty_strided",
        "zeros_like",
        "ones_like",
        "empty_like",
        "full_like",
        "as_tensor",
        "linspace",
        "randperm",
    ):
        setattr(torch, name, _wrap_factory(getattr(torch, name)))

    tensor_to = torch.Tensor.to

    @functools.wraps(tensor_to)
    def to(self, *args, **kwargs):
        if args and isinstance(args[0], (str, int, torch.device)) and not isinstance(args[0], bool):
            args = (_fix_device(args[0]),) + args[1:]
        if "device" in kwargs:
            kwargs["device"] = _fix_device(kwargs["device"])
        return tensor_to(self, *args, **kwargs)

    torch.Tensor.to = to
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.nn.Module.cuda = lambda self, *args, **kwargs: self
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self

    tensor_type = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and self.device.type == "cpu" and self.dtype in _TYPE_NAMES:
            return _TYPE_NAMES[self.dtype]
        return tensor_type(self, dtype, non_blocking, **kwargs) if dtype is not None else tensor_type(self)

    torch.Tensor.type = type_

    cuda = torch.cuda
    cuda.current_device = lambda: "cpu"
    cuda.set_device = lambda *args, **kwargs: None
    cuda.device_count = lambda: 1
    cuda.synchronize = lambda *args, **kwargs: None
    cuda.empty_cache = lambda: None
    cuda.Stream = _Stream
    cuda.Event = _Event
    cuda.current_stream = lambda *args, **kwargs: _Stream()
    cuda.default_stream = lambda *args, **kwargs: _Stream()
    cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: None  # torch.manual_seed calls it: the CPU generator is seeded already
    cuda.memory_allocated = lambda *args, **kwargs: 0
    cuda.max_memory_allocated = lambda *args, **kwargs: 0
    cuda.memory_reserved = lambda *args, **kwargs: 0
    cuda.max_memory_reserved = lambda *args, **kwargs: 0
    cuda.reset_peak_memory_stats = lambda *args, **kwargs: None
    cuda.nvtx.range_push = lambda *args, **kwargs: None
    cuda.nvtx.range_pop = lambda *args, **kwargs: None

    # Megatron's torch FSDP2 wrapper builds its mesh on "cuda"; FSDP2 itself runs on a CPU mesh.
    from megatron.core.distributed import torch_fully_sharded_data_parallel as torch_fsdp
    from torch.distributed.device_mesh import DeviceMesh

    def cpu_mesh(group, device_type, *args, **kwargs):
        return DeviceMesh.from_group(group, "cpu", *args, **kwargs)

    torch_fsdp.DeviceMesh = types.SimpleNamespace(from_group=cpu_mesh)

    # Megatron's torch_dist writer collects its results through a multiprocessing Manager started
    # by spawn, which imports the training script and Megatron again in a fresh process (about 7 s
    # of a CPU run's first save); forked, the Manager starts at once.
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not isinstance(filesystem_async.get_write_results_queue, functools.partial):
        filesystem_async.get_write_results_queue = functools.partial(filesystem_async.get_write_results_queue, mp_mode="fork")

    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    # The tracker's fork() warns when the CPU generator changed inside it, a check that assumes the
    # forked (CUDA) generator is another one. Here it is the CPU generator itself, so every random
    # draw inside a fork (each dropout) would warn; fork() still restores the state on exit.
    logging.getLogger(mrandom.__name__).addFilter(lambda record: record.getMessage() != "CPU RNG state changed within GPU RNG context")


def allow_pretrain() -> None:
    """:func:`install`, and let ``megatron.training.pretrain()`` run on CPU: its
    ``initialize_megatron`` asserts CUDA unless called with ``allow_no_cuda=True``, and argument
    validation asks the GPU's architecture at TP > 1 (answered: pre-Blackwell, whose settings the
    CPU ranks get: ``CUDA_DEVICE_MAX_CONNECTIONS=1``). Idempotent."""
    install()
    from megatron.training import arguments, training

    arguments.get_device_arch_version = lambda: 0

    initialize = training.initialize_megatron
    if not getattr(initialize, "_cpu", False):
        cpu_initialize = functools.partial(initialize, allow_no_cuda=True)
        cpu_initialize._cpu = True
        training.initialize_megatron = cpu_initialize


def main(argv: list[str] | None = None) -> None:
    """``python examples/megatron_cpu.py SCRIPT [ARGS...]`` (under torchrun for several ranks): run a
    Megatron-LM training script on CPU with Dion3 registered."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        raise SystemExit(0 if argv else 2)
    if not _given(argv, "--distributed-backend"):
        argv += ["--distributed-backend", "gloo"]
    iterations = _value(argv, "--train-iters")
    if not _given(argv, "--log-interval") and iterations is not None and iterations.isdigit():
        argv += ["--log-interval", str(max(1, int(iterations) // 10))]  # Megatron's default, 100, outlasts a CPU run
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the examples' own modules
    from megatron_quiet import quiet_megatron

    quiet_megatron()
    from dion3_megatron.megatron import launch

    launch.check_arguments(argv[1:])  # a bad Dion3 value stops here, before the CPU patches and Megatron's start
    if _given(argv, "--use-torch-fsdp2"):  # Megatron asks FSDP for several CUDA connections; the CPU has none
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "8"
    allow_pretrain()
    _readable_log()
    launch.main(argv)


def _given(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def _value(argv: list[str], flag: str) -> str | None:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def _readable_log() -> None:
    """Megatron's dump of every argument (hundreds of lines) only at its DEBUG logging level
    (``--logging-level 10`` or MEGATRON_LOGGING_LEVEL=10, read as Megatron reads them); the library's
    INFO lines (what fraction="auto" chose per matrix shape, once) printed."""
    from megatron.training import arguments

    print_args = arguments._print_args

    def args_at_debug(title, args):
        level = args.logging_level if args.logging_level is not None else os.environ.get("MEGATRON_LOGGING_LEVEL")
        if level is not None and int(level) <= logging.DEBUG:
            print_args(title, args)

    arguments._print_args = args_at_debug
    library = logging.getLogger("dion3_megatron")
    library.setLevel(logging.INFO)
    library.addHandler(logging.StreamHandler(sys.stdout))
    library.propagate = False  # Megatron may configure the root logger too: print once


def is_installed() -> bool:
    """True once :func:`install` has run in this process."""
    return _installed


if __name__ == "__main__":
    main()
