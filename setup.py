"""deepspeed-loco: LoCo error-feedback low-bit gradient communication for DeepSpeed ZeRO++ stage 3."""
from setuptools import find_packages, setup

setup(
    name="deepspeed-loco",
    version="0.1.0",
    description="LoCo error-feedback 4-bit (and 2/3/8-bit) gradient all-to-all for DeepSpeed ZeRO++ stage 3",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["deepspeed_loco", "deepspeed_loco.*"]),
    package_data={"deepspeed_loco": ["csrc/quantization/*", "data/*"]},
    include_package_data=True,
    python_requires=">=3.9",
    install_requires=["torch>=2.1", "deepspeed>=0.19.8", "ninja", "numpy", "tqdm",
                      "pydantic>=2"],
    extras_require={"test": ["pytest"], "hf": ["transformers", "accelerate"]},
    entry_points={"console_scripts": ["deepspeed-loco=deepspeed_loco.cli:main"]},
)
