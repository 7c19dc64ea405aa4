"""A simulated cluster on one device: what qgZ / LoCo with given bits, group size, ``err_beta``, Hadamard and node
layout does to training, before paying for cluster time (``SimulatedCluster``; the training loop is in
:mod:`deepspeed_loco.simulation.train`)."""
from deepspeed_loco.simulation.cluster import SimulatedCluster, SimulatedTopology
from deepspeed_loco.simulation.exchange import InProcessAllToAll

__all__ = ["SimulatedCluster", "SimulatedTopology", "InProcessAllToAll"]
