"""Chapter 06: the textbook's ResNet-18 variant for 28x28 images, with no lazy layers."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Residual(nn.Module):
    """ResNet's residual block; its input channels are given, so every layer exists at once."""

    def __init__(self, in_channels: int, channels: int, use_1x1conv: bool = False,
                 strides: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, padding=1, stride=strides)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv3 = nn.Conv2d(in_channels, channels, 1, stride=strides) if use_1x1conv else None
        self.bn1, self.bn2 = nn.BatchNorm2d(channels), nn.BatchNorm2d(channels)

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        Y = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(X)))))
        return F.relu(Y + (self.conv3(X) if self.conv3 is not None else X))


def resnet18(num_classes: int = 10, in_channels: int = 1) -> nn.Sequential:
    """d2l's ResNet-18 for small images (3x3 stem, no max-pool), with the same parameter names."""
    def stage(c_in: int, c_out: int, first: bool = False) -> nn.Sequential:
        return nn.Sequential(Residual(c_in, c_out) if first else
                             Residual(c_in, c_out, use_1x1conv=True, strides=2),
                             Residual(c_out, c_out))

    net = nn.Sequential(nn.Conv2d(in_channels, 64, 3, stride=1, padding=1),
                        nn.BatchNorm2d(64), nn.ReLU())
    for i, (c_in, c_out) in enumerate([(64, 64), (64, 128), (128, 256), (256, 512)], start=1):
        net.add_module(f"resnet_block{i}", stage(c_in, c_out, first=i == 1))
    net.add_module("global_avg_pool", nn.AdaptiveAvgPool2d((1, 1)))
    net.add_module("fc", nn.Sequential(nn.Flatten(), nn.Linear(512, num_classes)))
    return net


def init_weights(module: nn.Module) -> None:
    """The textbook's initialisation: N(0, 0.01) weights for every linear and conv layer."""
    if type(module) in (nn.Linear, nn.Conv2d):
        nn.init.normal_(module.weight, std=0.01)
