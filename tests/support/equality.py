"""A distributed run's parameters (or optimizer state), gathered whole, against the single-process
run's: the same names, each tensor within ``TOL``."""

from __future__ import annotations

import torch

# Orthogonalized in fp64, so that what differs is fp32 rounding: of the weights, the momentum and the
# gradients, reduced over ranks in another order (with tensor parallelism, partial products added in
# another order too). After three steps: about 2.5e-7 on the FSDP2 tests' small model (1e-6 with
# tensor parallelism), 5e-7 on torchtitan's llama3, 6e-7 on its deepseek_v3 (2e-6 with tensor
# parallelism). In fp32 the owner's other batch of the selected rows differs by up to 2e-5 on such
# small matrices; a wrong row, a lost step or a lost optimizer state differs by 1e-3 or more.
TOL = {"rtol": 5e-6, "atol": 5e-6}


def assert_equal(held: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    """``held`` names exactly the tensors ``expected`` names, each within ``TOL`` of its own;
    ``what`` (the case) starts each failure's message."""
    assert held.keys() == expected.keys(), (what, sorted(held.keys() ^ expected.keys()))
    for name, value in held.items():
        torch.testing.assert_close(value, expected[name], **TOL, msg=lambda m, n=name: f"{what} {n}: {m}")
