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
    package_data={"deepspeed_loco": ["csrc/quantization/*"]},
    include_package_data=True,
    python_requires=">=3.9",
    # what the library imports (ninja: the op builder's JIT build of the CUDA kernels; hjson: HJSON DeepSpeed configs;
    # numpy: the least-squares fit of deepspeed_loco.perf.calibration; scipy: the Student t quantile of
    # deepspeed_loco.utils.stats.t_interval)
    install_requires=["torch>=2.4", "deepspeed>=0.19.8", "pydantic>=2", "packaging", "hjson", "ninja", "numpy",
                      "scipy"],
    entry_points={"console_scripts": ["deepspeed-loco-report=deepspeed_loco.simulation.report:main"]},
    extras_require={
        "report": ["tqdm", "matplotlib"],  # deepspeed_loco.simulation.report: the progress bar and the PNG
        "demo": ["tqdm", "matplotlib"],  # loco_lab (the demo) and the benchmark drivers, run from a checkout
        "test": ["pytest", "tqdm", "matplotlib"],
        "hf": ["transformers", "accelerate"],
    },
)
