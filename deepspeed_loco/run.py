"""Runs an unmodified training script with LoCo available: ``python -m deepspeed_loco.run train.py [args...]``.

It calls :func:`deepspeed_loco.install` and then runs the script as ``__main__``, so the script's own
``deepspeed.initialize`` accepts ``zero_optimization.zeropp_loco_param``. Works under any launcher, e.g.
``torchrun --nproc_per_node 8 -m deepspeed_loco.run train.py --deepspeed_config ds.json`` or
``deepspeed --module deepspeed_loco.run train.py ...``.
"""
import runpy
import sys

import deepspeed_loco


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    deepspeed_loco.install()
    if argv[0] == "-m":
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
