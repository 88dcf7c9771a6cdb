from setuptools import find_packages, setup

setup(
    name="megalite",
    version="0.1.0",
    description="Compact Megatron-style 3D-parallel transformer training with Triton kernels",
    python_requires=">=3.10",
    # every package under megalite/ and kernels/, found (a hand-kept list once shipped a wheel without
    # megalite/planner); tests/test_packaging.py builds the wheel and checks it holds every module
    packages=find_packages(include=["megalite", "megalite.*", "kernels", "kernels.*"]),
    package_data={"megalite.cli": ["megatron_flags.json"],  # Megatron-LM's flag list (megalite/cli/compat.py)
                  "kernels": ["tuned_configs.json"]},  # the kernels' tuned launch configurations (kernels/tuned.py)
    install_requires=[
        "torch>=2.4",
        "triton>=3.0; platform_system == 'Linux'",
        "numpy",
        "sentencepiece",
        "datasets",
        "safetensors",  # checkpoints: pickle-free tensor files
    ],
    extras_require={
        # megatron-core: the data-format cross-checks against Megatron's own code
        # (tests/data/test_data_megatron_compat.py); its core needs only torch, numpy, packaging.
        # transformers: the HF conversion tests load real GPT2LMHeadModel / LlamaForCausalLM.
        # tensorboard: Megatron's launch scripts pass --tensorboard-dir (tests/test_megatron_scripts.py).
        # torchft: the fault-tolerant replicas' tests (tests/test_ft.py).
        # torchao: the external FP8 reference (its Float8Linear in emulation mode, tests/test_fp8_torchao.py).
        # transformers < 5.25: 5.25 requires Hugging Face's `kernels` distribution, whose import name is our
        # top-level `kernels` package; both cannot be installed (tests/test_packaging.py checks no other does).
        "test": ["pytest", "megatron-core>=0.16", "transformers<5.25", "matplotlib", "tensorboard", "torchft>=0.2",
                 "torchao>=0.18"],
        "hf": ["transformers<5.25", "safetensors"],
        "tensorboard": ["tensorboard"],
        "plot": ["matplotlib"],  # tools/plot_metrics.py
        "wandb": ["wandb"],  # --wandb-project (Weights & Biases logging, megalite/logger.py)
        "ft": ["torchft>=0.2"],  # --ft-lighthouse: fault-tolerant replicas (megalite/training/ft.py)
    },
)
