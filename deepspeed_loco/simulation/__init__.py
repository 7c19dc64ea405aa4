"""A simulated cluster on one device: what qgZ / LoCo with given bits, group size, ``err_beta``, Hadamard and node
layout would do to training, before paying for cluster time.

``SimulatedCluster``: ``W = M x L`` virtual ranks running the library's own reducer, error state and kernels, the
all-to-alls done in process. ``simulate(SimulationSpec(TrainingSetup(...), arms, steps))``: a training run per arm
on top of it (``train.py``); a ``StepObserver`` sees (and may act on) every step's reduce.
"""
from deepspeed_loco.simulation.arms import GRAMMAR, Arm, parse_arm, parse_arms, zeropp_loco_param
from deepspeed_loco.simulation.cluster import SimulatedCluster, SimulatedTopology, StreamedReduce
from deepspeed_loco.simulation.exchange import InProcessAllToAll
from deepspeed_loco.simulation.observer import ReducedStep, StepObserver
from deepspeed_loco.simulation.spec import SimulationSpec, TrainingSetup, default_loss
from deepspeed_loco.simulation.arm_result import ArmResult
from deepspeed_loco.simulation.train import gradient_noise_scale, simulate

__all__ = [
    "GRAMMAR", "Arm", "parse_arm", "parse_arms", "zeropp_loco_param", "SimulatedCluster", "SimulatedTopology",
    "StreamedReduce", "InProcessAllToAll", "ReducedStep", "StepObserver", "SimulationSpec", "TrainingSetup",
    "ArmResult", "default_loss", "gradient_noise_scale", "simulate"
]
