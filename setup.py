"""deepspeed-loco: LoCo error-feedback low-bit gradient communication for DeepSpeed ZeRO++ stage 3.

The distribution is the library (``deepspeed_loco``); the demo app (``loco_lab``), the benchmarks and the
examples run from a checkout of the repository and are not installed."""
from setuptools import find_packages, setup

setup(
    name="deepspeed-loco",
    version="0.1.0",
    description="LoCo error-feedback 4-bit (and 2/3/8-bit) gradient all-to-all for DeepSpeed ZeRO++ stage 3",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["deepspeed_loco", "deepspeed_loco.*"]),
    package_data={"deepspeed_loco": ["csrc/quantization/*", "perf/kernel_times.json", "findings.json"]},
    include_package_data=True,
    python_requires=">=3.9",
    # What the library imports, and no more. torch, deepspeed: the product. pydantic: LocoConfig, the validated
    # zeropp_loco_param block (DeepSpeed's own config is pydantic too). packaging: the DeepSpeed version check of
    # runtime/zero/deepspeed_seam.py. hjson: HJSON DeepSpeed config files, read as DeepSpeed reads them. ninja: the op
    # builder's JIT build of the CUDA kernels. numpy and scipy are not needed: the Student-t quantile is computed in
    # utils/stats.py (DeepSpeed itself still requires numpy).
    # Tested: DeepSpeed 0.19.8 with torch 2.13.0 (CPU; CI), 2.15.0 (on CPU: tests/unit/runtime, ops, utils and
    # test_config.py through scripts/test_torch_version.sh, 361 passed), 2.11.0+cu130 (one H100 and one H200; on CPU
    # tests/unit and tests/benchmarks, 822 passed, the 3 wheel-building ones without `wheel` in that venv). Other
    # torch releases >= 2.4 are not refused, only untested.
    install_requires=["torch>=2.4", "deepspeed>=0.19.8", "pydantic>=2", "packaging", "hjson", "ninja"],
    classifiers=[
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Operating System :: POSIX :: Linux",
        "Environment :: GPU :: NVIDIA CUDA",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
    entry_points={"console_scripts": ["deepspeed-loco-report=deepspeed_loco.simulation.report:main",
                                      "deepspeed-loco-advise=deepspeed_loco.simulation.advise_cli:main"]},
    extras_require={
        "report": ["tqdm", "matplotlib"],  # deepspeed_loco.simulation.report's PNG, deepspeed-loco-advise's bar
        # loco_lab (the demo) and the benchmark drivers, run from a checkout: numpy and scipy for the regime map's
        # statistics (benchmarks/pooling.py, benchmarks/map_statistics.py)
        "demo": ["tqdm", "matplotlib", "numpy", "scipy"],
        "test": ["pytest", "tqdm", "matplotlib", "numpy", "scipy"],  # the benchmarks' tests, the t-quantile check
        "hf": ["transformers", "accelerate"],
    },
)
