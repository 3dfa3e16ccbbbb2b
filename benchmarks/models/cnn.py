"""A small ResNet (basic blocks, batch norm) on 3 x 64 x 64 images, 10 classes: a file model for
meshplan's CPU fidelity benchmark. `build` is the spec's function; `loss_fn` makes it trainable.

    meshplan plan --model benchmarks/models/cnn.py:build --cluster cpu --gpus 2 --gbs 8 --seq 1
"""
import torch
import torch.nn.functional as F
from torch import nn


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.skip = (nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))
                     if stride != 1 or c_in != c_out else nn.Identity())

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.skip(x))


class ResNet(nn.Module):
    def __init__(self, widths=(32, 64, 128), num_classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU())
        self.stage1 = nn.Sequential(BasicBlock(widths[0], widths[0], 1), BasicBlock(widths[0], widths[0], 1))
        self.stage2 = nn.Sequential(BasicBlock(widths[0], widths[1], 2), BasicBlock(widths[1], widths[1], 1))
        self.stage3 = nn.Sequential(BasicBlock(widths[1], widths[2], 2), BasicBlock(widths[2], widths[2], 1))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(widths[2], num_classes))

    def forward(self, x, labels=None):  # labels: the loss's input, fed with the images
        return self.head(self.stage3(self.stage2(self.stage1(self.stem(x)))))


def build():
    return ResNet(), (torch.randn(1, 3, 64, 64), torch.randint(0, 10, (1,)))


def loss_fn(output, inputs):
    return F.cross_entropy(output, inputs[1])
