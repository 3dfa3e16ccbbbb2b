"""ResNet-50 (He et al. 2016): bottleneck blocks in stages of 3, 4, 6 and 3, widths 256 to 2048,
batch norm, 224 x 224 images and a 1000-class head (25.6M parameters). A file model for planning
image models with large micro-batches.

    meshplan plan --model benchmarks/models/resnet50.py:build --cluster h100-sxm --gpus 8 --gbs 4096 --seq 1
"""
import torch
import torch.nn.functional as F
from torch import nn


class Bottleneck(nn.Module):
    def __init__(self, c_in: int, width: int, stride: int):
        super().__init__()
        c_out = 4 * width
        self.conv1 = nn.Conv2d(c_in, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, c_out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(c_out)
        self.skip = (nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))
                     if stride != 1 or c_in != c_out else nn.Identity())

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        return F.relu(self.bn3(self.conv3(y)) + self.skip(x))


def _stage(c_in: int, width: int, blocks: int, stride: int) -> nn.Sequential:
    return nn.Sequential(Bottleneck(c_in, width, stride), *(Bottleneck(4 * width, width, 1) for _ in range(blocks - 1)))


class ResNet50(nn.Module):
    def __init__(self, num_classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        self.layer1 = _stage(64, 64, 3, 1)
        self.layer2 = _stage(256, 128, 4, 2)
        self.layer3 = _stage(512, 256, 6, 2)
        self.layer4 = _stage(1024, 512, 3, 2)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2048, num_classes))

    def forward(self, x, labels=None):  # labels: the loss's input, fed with the images
        return self.head(self.layer4(self.layer3(self.layer2(self.layer1(self.stem(x))))))


def build():
    return ResNet50(), (torch.randn(1, 3, 224, 224), torch.randint(0, 1000, (1,)))


def loss_fn(output, inputs):
    return F.cross_entropy(output, inputs[1])
