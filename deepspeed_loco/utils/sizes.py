"""Sizes in words, for the lines the library writes."""


def parameter_count(params: int) -> str:
    """A model's size in words, three significant digits where rounded: ``3,217 parameters`` (below 100,000),
    ``0.87M parameters``, ``10.8M parameters``, ``116M parameters``, ``7B parameters``."""
    if params < 100_000:
        return f"{params:,} parameters"
    if params < 1_000_000_000:
        return f"{params / 1e6:.3g}M parameters"
    return f"{params / 1e9:.3g}B parameters"
