"""The LoCo demo: a tiny Llama-style byte-level model trained on bundled Shakespeare by several simulated
nodes, once per arm (full-precision reduce-scatter, plain low-bit qgZ, qgZ + LoCo), with a table and a PNG.

``python -m loco_lab.cli demo --help`` lists the flags; ``run_demo(spec)`` is the programmatic entry.
"""
