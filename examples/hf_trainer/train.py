"""Hugging Face Trainer + DeepSpeed with Dion3: the optimizer comes from the DeepSpeed JSON config.

    deepspeed --num_gpus 1 examples/hf_trainer/train.py --deepspeed examples/hf_trainer/ds_config_dion3.json \
        --bf16 --learning_rate 0.01 --max_steps 200
    # CPU, 2 ranks:
    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node 2 examples/hf_trainer/train.py \
        --deepspeed examples/hf_trainer/ds_config_dion3.json --use_cpu \
        --learning_rate 0.01 --max_steps 20 --width 64 --layers 2 --seq 64

The only Dion3-specific line is ``import dion3_megatron.deepspeed`` (it registers
``"type": "Dion3"`` and splits the flat parameter list Trainer hands DeepSpeed by module:
embeddings, the output head, norms and vectors take AdamW, hidden matrices Dion3). Every other
flag is Trainer's own (``TrainingArguments``). The model is built from a config (random init, no
download): a Llama-style model (``--model llama``) or GPT-2 (``--model gpt2``; its ``Conv1D``
layers are converted with ``conv1d_as_linear`` so that Dion3 takes them, unless
``--keep_conv1d``). Bytes of the running Python's standard library are the corpus (vocab 256, no
tokenizer). Trainer's ``--output_dir`` defaults to runs/hf_trainer. At the end rank 0 prints one
JSON line: the final loss (Trainer's loss logged at the last step: the mean over the steps since
the previous log, ``final_loss_steps`` of them), median iteration time, median time of the
optimizer's own step() and the rest.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time

import torch
from transformers import HfArgumentParser, Trainer, TrainerCallback, TrainingArguments

import dion3_megatron.deepspeed  # noqa: F401  registers "type": "Dion3" for DeepSpeed configs

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # examples/: the shared modules
from deepspeed_setup import quiet_deprecated_collectives, skip_shared_memory_op  # noqa: E402
from leave_process_group import leave_process_group  # noqa: E402
from step_timer import StepTimer  # noqa: E402
from stdlib_text import stdlib_tokens  # noqa: E402


@dataclasses.dataclass
class ModelArguments:
    model: str = dataclasses.field(default="llama", metadata={"help": "llama or gpt2"})
    width: int = dataclasses.field(default=512, metadata={"help": "hidden size"})
    layers: int = dataclasses.field(default=8, metadata={"help": "transformer layers"})
    heads: int = dataclasses.field(default=8, metadata={"help": "attention heads"})
    seq: int = dataclasses.field(default=512, metadata={"help": "tokens per sequence"})
    keep_conv1d: bool = dataclasses.field(default=False, metadata={"help": "gpt2: leave Conv1D (its weights take AdamW)"})
    corpus_bytes: int = dataclasses.field(default=8_000_000, metadata={"help": "bytes of the corpus read"})
    json: str = dataclasses.field(default="", metadata={"help": "write the summary here"})


class Bytes(torch.utils.data.Dataset):
    """Fixed windows of the standard library's sources, one byte per token."""

    def __init__(self, seq: int, max_bytes: int) -> None:
        data = stdlib_tokens(max_bytes)
        self.windows = data[: data.numel() // seq * seq].view(-1, seq)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.windows[i], "labels": self.windows[i]}


def build_model(m: ModelArguments) -> torch.nn.Module:
    if m.model == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(
            LlamaConfig(
                vocab_size=256,
                hidden_size=m.width,
                intermediate_size=m.width * 8 // 3 // 64 * 64 or 64,
                num_hidden_layers=m.layers,
                num_attention_heads=m.heads,
                num_key_value_heads=m.heads,
                max_position_embeddings=m.seq,
                tie_word_embeddings=False,
            )
        )
    if m.model == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=m.width, n_layer=m.layers, n_head=m.heads, n_positions=m.seq))
        if not m.keep_conv1d:
            dion3_megatron.deepspeed.conv1d_as_linear(model)
        return model
    raise ValueError(f"--model must be llama or gpt2, got {m.model!r}")


class Timing(TrainerCallback):
    """Wall time of each optimizer step (Trainer's step: forward, backward, engine step) and of the
    DeepSpeed optimizer's own step() inside it (on ZeRO's flat slices; summed over param groups)."""

    def __init__(self) -> None:
        self.iter_ms: list[float] = []
        self.optimizer_ms: list[float] = []
        self.optimizer_step = StepTimer(self._sync)
        self._t0 = 0.0
        self.engine = None

    @staticmethod
    def _sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def wrap(self, engine) -> None:
        self.optimizer_step.wrap(engine.basic_optimizer)
        self.engine = engine

    def on_step_begin(self, args, state, control, **kwargs):
        self._sync()
        self._t0 = time.perf_counter()
        self.optimizer_step.take()  # a new sum for this step

    def on_step_end(self, args, state, control, **kwargs):
        self._sync()
        self.iter_ms.append((time.perf_counter() - self._t0) * 1e3)
        self.optimizer_ms.append(self.optimizer_step.take() * 1e3)


class LogLastStep(TrainerCallback):
    """Have Trainer log the loss at the last step too (it logs every --logging_steps, 500 by
    default), so that the summary has a final loss whatever the interval."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= state.max_steps:
            control.should_log = True


class WrapOnTrainBegin(TrainerCallback):
    def __init__(self, trainer_ref: list, timing: Timing) -> None:
        self.trainer_ref, self.timing = trainer_ref, timing

    def on_train_begin(self, args, state, control, **kwargs):
        engine = self.trainer_ref[0].model_wrapped
        if hasattr(engine, "basic_optimizer"):
            self.timing.wrap(engine)


def main() -> None:
    skip_shared_memory_op()  # before TrainingArguments, whose device setup starts DeepSpeed's process group
    quiet_deprecated_collectives()
    parser = HfArgumentParser((ModelArguments, TrainingArguments))
    parser.set_defaults(output_dir=os.path.join("runs", "hf_trainer"))  # Trainer's own: trainer_output
    margs, targs = parser.parse_args_into_dataclasses()
    if targs.report_to in (None, "all", ["all"]):
        targs.report_to = []
    torch.manual_seed(targs.seed)
    model = build_model(margs)
    timing, ref = Timing(), []
    trainer = Trainer(model=model, args=targs, train_dataset=Bytes(margs.seq, margs.corpus_bytes), callbacks=[timing, LogLastStep()])
    ref.append(trainer)
    trainer.add_callback(WrapOnTrainBegin(ref, timing))
    trainer.train()
    if trainer.is_world_process_zero():
        logged = [h for h in trainer.state.log_history if "loss" in h]
        losses = [h["loss"] for h in logged]
        warm = slice(min(5, len(timing.iter_ms) - 1), None)
        config = targs.deepspeed
        if isinstance(config, str):
            with open(config) as f:
                config = json.load(f)
        summary = {
            "optimizer": ((config or {}).get("optimizer") or {}).get("type", "Trainer's own"),
            "model": {**dataclasses.asdict(margs), "params": sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())},
            "steps": len(timing.iter_ms),
            "final_loss": losses[-1],
            "final_loss_steps": logged[-1]["step"] - (logged[-2]["step"] if len(logged) > 1 else 0),
            "final_loss_mean_last10": statistics.mean(losses[-10:]),
            "median_iter_ms": statistics.median(timing.iter_ms[warm]),
            "median_optimizer_step_ms": statistics.median(timing.optimizer_ms[warm]),
            "world": targs.world_size,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        }
        print("SUMMARY " + json.dumps(summary), flush=True)
        if margs.json:
            with open(margs.json, "w") as f:
                json.dump({**summary, "losses": losses}, f, indent=1)
    leave_process_group()


if __name__ == "__main__":
    main()
