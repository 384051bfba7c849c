"""What the tests share (``from support import dist_utils``; pytest puts tests/ on sys.path, and
tests/conftest.py the repository root, so that the examples and benchmarks import as
``examples.X`` and ``benchmarks.X``). Importing a module here changes nothing in the process:

- ``repository``: where the repository's files are (its root, tests/), and its tools/ scripts as modules.
- ``dist_utils``: run a test function on N processes (gloo, or NCCL on GPUs).
- ``equality``: a distributed run's tensors against the single-process run's (names, tolerance).
- ``megatron_flags``: Megatron-LM flags the runs share (torch's own layers, no fused kernels).
- ``megatron_shim``: a tiny Megatron-Core GPT on CPU, the single-process reference, a training step.
- ``deepspeed_helpers``: DeepSpeed on CPU: tiny models, engines, the multi-rank sessions.
- ``torchtitan_helpers``: torchtitan on CPU: its llama3 model parallelized by its own functions, its
  optimizer container and checkpoint manager, the settings, the single-process reference, the session.
- ``hf_trainer_helpers``: Hugging Face Trainer + DeepSpeed on CPU: tiny models, the session.
- ``script_helpers``: the examples' shell scripts run with a python3 that records its arguments.
- ``one_process``: scripts' runs that end in their parsers (--help, a usage error), many in one interpreter.
- ``readme``: the commands README.md shows.
"""
