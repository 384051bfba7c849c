from setuptools import find_packages, setup

EXTRAS = {
    # examples/pretrain_gpt.py (the main job): progress bar, --compare's plot. --optimizer muon (and
    # --compare's Muon): Megatron-Core 0.19 imports emerging_optimizers (>= 0.2 for its NSCoeffT;
    # Megatron-LM 0.19 locks 0.2.0 from git, PyPI has 0.3.0, tested), which imports absl (Megatron-LM
    # 0.19 locks absl-py 2.5.0). Dion3 itself needs neither.
    "megatron": ["megatron-core==0.19.*", "tqdm", "matplotlib", "emerging-optimizers>=0.3", "absl-py>=2.5"],
    "deepspeed": ["deepspeed>=0.19,<0.20"],
    "kernels": ["nvidia-cutlass-dsl[cu13]>=4.8"],
    # Hugging Face Trainer + DeepSpeed (examples/hf_trainer, tests/test_hf_trainer.py): Trainer needs accelerate.
    "hf": ["deepspeed>=0.19,<0.20", "transformers>=5,<6", "accelerate>=1.1"],
}
HF_ONLY = [r for r in EXTRAS["hf"] if r not in EXTRAS["deepspeed"]]
# The tests exercise the integrations on CPU, so they need the frameworks.
EXTRAS["test"] = ["pytest>=8", "numpy"] + EXTRAS["megatron"] + EXTRAS["deepspeed"] + HF_ONLY
EXTRAS["all"] = sorted({req for reqs in EXTRAS.values() for req in reqs})

setup(
    name="dion3-megatron",
    version="0.1.0",
    description="The Dion3 optimizer for Megatron-Core, DeepSpeed and PyTorch",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["dion3_megatron", "dion3_megatron.*"]),
    python_requires=">=3.12",
    install_requires=["torch>=2.4"],
    extras_require=EXTRAS,
    license="Apache-2.0",
)
