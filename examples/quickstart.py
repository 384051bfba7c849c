"""Train a small byte-level transformer with Dion3 on CPU (or a GPU when present) and print the loss.

The model is examples/small_gpt.py's GPT; the corpus is the running Python's own standard-library
sources: nothing to download.
Usage: python examples/quickstart.py [--steps 200] [--fraction auto|0.25|...]
"""

import math
import time

import torch

from dion3_megatron import Dion3
from dion3_megatron.options import BY_NAME
from example_args import ExampleParser
from small_gpt import GPT  # examples/small_gpt.py and examples/stdlib_text.py, beside this script
from stdlib_text import stdlib_tokens

FRACTION = BY_NAME["fraction"]


def main() -> None:
    parser = ExampleParser(description=__doc__.splitlines()[0], other_spellings={"--dion3-fraction": "--fraction"})
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps")
    parser.add_argument("--batch", type=int, default=16, help="sequences per step")
    parser.add_argument("--context", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--fraction", type=FRACTION.argparse_type(), default=FRACTION.default, help=f"Dion3's f: {FRACTION.allowed()}")
    parser.add_argument("--lr", type=float, default=BY_NAME["lr"].default, help="Dion3's learning rate")
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    data = stdlib_tokens(4_000_000).to(device)
    split = int(0.95 * len(data))
    model = GPT(width=128, layers=2, heads=4, context=args.context).to(device)
    # Hidden-layer matrices take Dion3; embeddings, the output head and 1-D params take AdamW.
    hidden = [p for n, p in model.named_parameters() if n.startswith("blocks") and p.dim() >= 2]
    hidden_ids = {id(p) for p in hidden}
    rest = [p for p in model.parameters() if id(p) not in hidden_ids]
    opt = Dion3(
        [{"params": hidden}, {"params": rest, "algorithm": "adamw", "lr": 3e-3}],
        lr=args.lr,
        fraction=args.fraction,
    )

    def batch(lo: int, hi: int) -> torch.Tensor:
        """``--batch`` random windows of context + 1 bytes of data[lo:hi]."""
        starts = torch.randint(lo, hi - args.context - 1, (args.batch,), device=device)
        return data[starts[:, None] + torch.arange(args.context + 1, device=device)]

    print(
        f"Dion3 fraction={args.fraction} on {device}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, "
        f"{len(data) / 1e6:.1f}M bytes of stdlib source"
    )
    start = time.time()
    for step in range(1, args.steps + 1):
        loss = model(batch(0, split))  # the mean cross-entropy of each next byte
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 20 == 0 or step == 1:
            rate = step * args.batch * args.context / (time.time() - start)
            print(f"step {step:4d}  loss {loss.item():.3f}  ({rate:,.0f} tokens/s)", flush=True)
    with torch.no_grad():
        val = sum(model(batch(split, len(data))).item() for _ in range(10)) / 10
    print(f"validation loss {val:.3f} ({val / math.log(2):.2f} bits/byte)")
    if args.fraction == "auto":
        fractions = opt.fractions  # {name: f}; a parameter works as a key too
        chosen = sorted({(tuple(p.shape), fractions[p]) for p in hidden})
        print("fraction=auto chose (shape: f) " + ", ".join(f"{'x'.join(map(str, s))}: {f:g}" for s, f in chosen))


if __name__ == "__main__":
    main()
