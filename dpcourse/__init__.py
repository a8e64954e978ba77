"""dpcourse: data-parallel training from scratch.

One module per idea a chapter builds (the README maps them to the chapters); the measurement
drivers the notebooks and the benchmark run live in dpcourse.experiments.
"""
from .collectives import allreduce, broadcast, get_params
from .data import CLASSES, fashion_mnist, load_fashion_mnist, synthetic_fashion
from .ddp import ScratchDDP
from .hardware import Timer, accelerators, devices, synchronize
from .lenet import init_lenet_params, lenet, loss
from .ring import ring_allreduce, ring_schedule
from .split import split_batch
from .training import Settings, TrainResult, evaluate_accuracy, sgd, train, train_batch

__all__ = ["CLASSES", "ScratchDDP", "Settings", "Timer", "TrainResult", "accelerators",
           "allreduce", "broadcast", "devices", "evaluate_accuracy", "fashion_mnist",
           "get_params", "init_lenet_params", "lenet", "load_fashion_mnist", "loss",
           "ring_allreduce", "ring_schedule", "sgd", "split_batch", "synchronize",
           "synthetic_fashion", "train", "train_batch"]
