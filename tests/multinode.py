"""Several torchrun agents on this machine, each standing in for a node: the tests' helper is
chapter 12's (dpcourse/experiments/nodes.py), which the notebook runs too."""
from dpcourse.experiments.nodes import MARK, Cluster, environment, free_port

__all__ = ["MARK", "Cluster", "environment", "free_port"]
