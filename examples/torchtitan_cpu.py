"""Run torchtitan's trainer on CPU processes (gloo), for demos and tests.

    torchrun --standalone --nproc-per-node 2 examples/torchtitan_cpu.py \\
        --module dion3_megatron.torchtitan --config llama3_debugmodel_dion3 \\
        --training.steps 4 --training.seq_len 64 --training.local_batch_size 4

Every argument is ``python -m torchtitan.train``'s. torchtitan 0.3.0 runs on an accelerator ("cuda"
when it finds none); this script patches three things in its own process, before torchtitan builds
anything, so that the trainer runs on CPU ranks. None is in the optimizer, and none changes what
the model computes:

- the device: torchtitan's device type is "cpu", and its device module answers what torchtitan asks
  of one that ``torch.cpu`` does not: an integer device index (a barrier's ``device_ids``), a name
  and a capacity, and memory statistics (here the process's peak resident memory);
- the attention: FlexAttention has no backward on CPU, so the same masked attention (the block
  mask's ``mask_mod`` evaluated densely) runs through torch's SDPA, and the block mask is made
  without ``torch.compile`` (which on CPU compiles C++, some ten seconds a process);
- FSDP's gradient reduction: torchtitan turns FSDP's gradient division off, which FSDP does with a
  PREMUL_SUM by 1; gloo has no PREMUL_SUM, so FSDP reduces with a plain sum (the same values).

torchtitan's test tokenizer and ``c4_test`` data are not in its wheel: without ``--hf_assets_path``
the script writes a byte-level tokenizer (a token per byte, BOS and EOS), and without
``--dataloader.dataset_path`` the standard library's Python sources in ``c4_test``'s format, both
into ``dion3-torchtitan-cpu`` under the system's temporary folder (once; later runs reuse them,
with the datasets cache kept beside them).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the examples' own modules, also when imported by path
from stdlib_text import write_once, write_stdlib_corpus  # noqa: E402

DATA = Path(tempfile.gettempdir()) / "dion3-torchtitan-cpu"
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


class CpuDeviceModule:
    """``torch.cpu`` as torchtitan's device module, with what torchtitan asks of one that it lacks."""

    def __getattr__(self, name: str):
        return getattr(torch.cpu, name)

    def current_device(self) -> int:
        return 0  # torch.cpu says "cpu"; a barrier's device_ids must be integers

    def get_device_name(self, device=None) -> str:
        return "cpu"

    def get_device_properties(self, device=None) -> SimpleNamespace:
        return SimpleNamespace(total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    def memory_stats(self, device=None) -> dict[str, int]:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
        return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak}

    def reset_peak_memory_stats(self, device=None) -> None:
        pass  # a process's peak resident memory cannot be reset

    def empty_cache(self) -> None:
        pass


def dense_flex_attention(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
    """FlexAttention's result for torchtitan's language models (a block mask, no score_mod, no
    log-sum-exp asked), computed by SDPA with the block mask's mask_mod as a dense boolean mask."""
    from torch.nn.attention.flex_attention import create_mask

    if score_mod is not None or return_aux.lse:
        raise NotImplementedError("examples/torchtitan_cpu.py: FlexAttention with a score_mod or its log-sum-exp")
    mask = create_mask(block_mask.mask_mod, q.shape[0], 1, q.shape[-2], k.shape[-2], device=q.device)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    return out, None


def install() -> None:
    """The three patches of the module docstring, in this process. Call before torchtitan's other
    modules are imported: they take torchtitan.tools.utils' device when they are."""
    import torchtitan.tools.utils as titan_utils  # chooses the device; the other modules import its choice

    titan_utils.device_type, titan_utils.device_module = "cpu", CpuDeviceModule()
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.distributed import fsdp
    from torchtitan.models.common import attention

    attention.FlexAttention._compiled_flex_attn = staticmethod(dense_flex_attention)
    attention._compiled_create_block_mask = create_block_mask
    divide_off = fsdp.disable_fsdp_gradient_division

    def plain_sum(model: torch.nn.Module) -> None:
        divide_off(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    fsdp.disable_fsdp_gradient_division = plain_sum


def byte_tokenizer(folder: Path) -> Path:
    """A Hugging Face tokenizer of one token per byte (ids 0-255) and BOS and EOS (256 and 257), with
    the tokenizer_config.json that names them, in ``folder``, as torchtitan's HuggingFaceTokenizer
    reads them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(byte_level.alphabet()))}, merges=[]))
    tokenizer.pre_tokenizer, tokenizer.decoder = byte_level, decoders.ByteLevel()
    tokenizer.add_special_tokens([BOS, EOS])
    write_once(folder / "tokenizer.json", [tokenizer.to_str()])
    write_once(folder / "tokenizer_config.json", [json.dumps({"bos_token": BOS, "eos_token": EOS})])
    return folder


def _given(argv: list[str], flag: str) -> bool:
    """Whether torchtitan's command line sets ``flag`` (tyro spells it with _ or -, = or a space)."""
    spellings = {flag, flag.replace("_", "-")}
    return any(a.split("=", 1)[0] in spellings for a in argv)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not _given(argv, "--hf_assets_path"):
        argv.append(f"--hf_assets_path={byte_tokenizer(DATA / 'tokenizer')}")
    if not _given(argv, "--dataloader.dataset_path"):
        os.environ.setdefault("HF_DATASETS_CACHE", str(DATA / "datasets-cache"))
        argv.append(f"--dataloader.dataset_path={write_stdlib_corpus(DATA / 'c4_test')}")
    install()
    from torchtitan.train import main as train

    sys.argv = [sys.argv[0], *argv]  # torchtitan's ConfigManager reads sys.argv
    train()


if __name__ == "__main__":
    main()
