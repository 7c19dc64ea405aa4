"""deepspeed-loco: LoCo error-feedback low-bit gradient communication for DeepSpeed ZeRO++ stage 3."""
__version__ = "0.1.0"
