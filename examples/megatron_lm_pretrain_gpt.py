"""A minimal Megatron-LM 0.19 ``pretrain_gpt.py`` on synthetic data, for trying ``--optimizer dion3``.

    torchrun --nproc-per-node 2 -m dion3_megatron.megatron.launch examples/megatron_lm_pretrain_gpt.py \\
        --optimizer dion3 --use-distributed-optimizer --bf16 --tensor-model-parallel-size 2 \\
        --num-layers 8 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 \\
        --max-position-embeddings 1024 --micro-batch-size 8 --global-batch-size 8 \\
        --train-iters 100 --lr 0.01 --transformer-impl local --no-gradient-accumulation-fusion ...

It makes the calls Megatron-LM's own ``pretrain_gpt.py`` (branch core_r0.19.0) makes:
``parse_and_validate_args``, ``gpt_config_from_args``, ``pretrain_cfg_container_from_args`` and
``megatron.training.pretrain`` with the model config (no model provider), so ``pretrain()`` builds
the model, DDP and the optimizer exactly as it does for that script. Only the data differ: a
learnable synthetic language (each token follows a fixed random successor with probability 0.75,
else uniform; training, validation and test are different samples of it), generated per sample
index so every rank agrees without a data pipeline or a tokenizer file. ``--tokenizer-type``
defaults to NullTokenizer and ``--vocab-size`` to 32768 (the synthetic language's alphabet). Run it
through the launcher (which registers Dion3 and skips the ``make`` of Megatron's dataset helpers
that the megatron-core wheel ships compiled), on CPU (gloo) through ``examples/megatron_cpu.py``.
"""

from __future__ import annotations

import torch

from megatron.core.enums import ModelType
from megatron.training import get_args, pretrain
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args

VOCAB = 32768  # --vocab-size unless given


class SyntheticLanguage(torch.utils.data.Dataset):
    """``samples`` sequences of one language (its successor table drawn from ``seed``); ``split``
    draws other sequences of the same language (train, validation and test: 0, 1, 2)."""

    def __init__(self, samples: int, seq: int, vocab: int, seed: int, split: int = 0) -> None:
        self.samples, self.seq, self.vocab, self.seed, self.split = samples, seq, vocab, seed, split
        self.successor = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> dict:
        g = torch.Generator().manual_seed(((self.seed * 3 + self.split) << 32) + index)  # one stream per sample
        tokens = torch.empty(self.seq + 1, dtype=torch.long)
        tokens[0] = torch.randint(0, self.vocab, (1,), generator=g)
        noise = torch.randint(0, self.vocab, (self.seq,), generator=g)
        keep = torch.rand(self.seq, generator=g) < 0.75
        for i in range(self.seq):
            tokens[i + 1] = self.successor[tokens[i]] if keep[i] else noise[i]
        return {"tokens": tokens[:-1], "labels": tokens[1:], "loss_mask": torch.ones(self.seq), "position_ids": torch.arange(self.seq)}


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    args = get_args()
    return [
        SyntheticLanguage(max(int(n), 1), args.seq_length, args.padded_vocab_size, args.seed, split)
        for split, n in enumerate(train_val_test_num_samples)
    ]


train_valid_test_datasets_provider.is_distributed = True


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    device = next(model.parameters()).device
    tokens, labels, loss_mask, position_ids = (
        batch[k].to(device, non_blocking=True) for k in ("tokens", "labels", "loss_mask", "position_ids")
    )
    output = model(tokens, position_ids, None, labels=labels)
    return output, lambda out: loss_func(loss_mask, out)


def main() -> None:
    # NullTokenizer takes its size from --vocab-size (without one Megatron fails deep in the
    # tokenizer build with "missing 1 required positional argument: 'vocab_size'").
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer", "vocab_size": VOCAB})
    cfg = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
    pretrain(cfg, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step)


if __name__ == "__main__":
    main()
