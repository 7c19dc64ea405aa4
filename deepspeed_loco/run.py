"""Runs an unmodified training script with LoCo available.

``python -m deepspeed_loco.run [--local_rank=N] (script.py | -m module) [args...]`` calls
:func:`deepspeed_loco.install` and then runs the script (or module) as ``__main__``, so its own
``deepspeed.initialize`` accepts ``zero_optimization.zeropp_loco_param``. Works under any launcher:

* ``torchrun --nproc_per_node 8 -m deepspeed_loco.run train.py --deepspeed_config ds.json``
* ``deepspeed --num_gpus 8 --module deepspeed_loco.run train.py --deepspeed_config ds.json``

The ``deepspeed`` launcher puts ``--local_rank=N`` right after the module it runs, i.e. before ``train.py``;
it meant the option for the training script, so it is handed on as the script's first argument (where the
launcher puts it when it runs the script directly). With ``--no_local_rank`` nothing is moved.
"""
import os
import runpy
import sys
from typing import List, Tuple

import deepspeed_loco
from deepspeed_loco.utils import clean_exit

_LOCAL_RANK_FLAGS = ("--local_rank", "--local-rank")


def split_argv(argv: List[str]) -> Tuple[List[str], List[str]]:
    """Splits the runner's arguments into (``--local_rank`` options the launcher put before the script,
    the script's path or ``-m module`` and its arguments). Raises ``SystemExit`` naming what is wrong."""
    leading = []
    rest = list(argv)
    while rest and rest[0].split("=", 1)[0] in _LOCAL_RANK_FLAGS:
        flag = rest.pop(0)
        if "=" not in flag:
            if not rest:
                raise SystemExit(f"deepspeed_loco.run: {flag} needs a value")
            flag = f"{flag}={rest.pop(0)}"
        leading.append(flag)
    if not rest or (rest[0] == "-m" and len(rest) < 2):
        raise SystemExit("deepspeed_loco.run: expected a script path or -m module (see --help)")
    if rest[0].startswith("-") and rest[0] != "-m":
        raise SystemExit(f"deepspeed_loco.run: unexpected option {rest[0]!r} before the script; expected a script "
                         f"path or -m module, optionally after --local_rank=N")
    return leading, rest


def main(argv=None) -> None:
    """Installs LoCo and runs the script with ``sys.argv`` as it would see it launched directly."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    leading, target = split_argv(argv)
    deepspeed_loco.install()
    try:
        if target[0] == "-m":
            sys.argv = [target[1], *leading, *target[2:]]
            runpy.run_module(target[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = [target[0], *leading, *target[1:]]
            sys.path.insert(0, os.path.dirname(os.path.abspath(target[0])))  # as ``python script.py`` would
            runpy.run_path(target[0], run_name="__main__")
    except SystemExit as stop:
        if stop.code in (None, 0):  # a script that ends with sys.exit(0) ended well
            clean_exit.release()
        raise
    clean_exit.release()


if __name__ == "__main__":
    main()
