"""A UNet-like encoder/decoder (conv + group norm + SiLU, skip connections, transposed-conv
upsampling) on 3 x 64 x 64 images, trained to reconstruct its input: a file model for meshplan's
CPU fidelity benchmark.

    meshplan plan --model benchmarks/models/unet.py:build --cluster cpu --gpus 2 --gbs 8 --seq 1
"""
import torch
import torch.nn.functional as F
from torch import nn


def conv_block(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.GroupNorm(8, c_out), nn.SiLU(),
                         nn.Conv2d(c_out, c_out, 3, padding=1), nn.GroupNorm(8, c_out), nn.SiLU())


class Down(nn.Module):
    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.conv = conv_block(c_in, c_out)

    def forward(self, x):
        return self.conv(F.max_pool2d(x, 2))


class Up(nn.Module):
    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.up = nn.ConvTranspose2d(c_in, c_out, 2, stride=2)
        self.conv = conv_block(2 * c_out, c_out)

    def forward(self, x, skip):
        return self.conv(torch.cat([self.up(x), skip], dim=1))


class UNet(nn.Module):
    def __init__(self, widths=(32, 64, 128)):
        super().__init__()
        self.enc0 = conv_block(3, widths[0])
        self.enc1 = Down(widths[0], widths[1])
        self.mid = Down(widths[1], widths[2])
        self.dec1 = Up(widths[2], widths[1])
        self.dec0 = Up(widths[1], widths[0])
        self.out = nn.Conv2d(widths[0], 3, 1)

    def forward(self, x):
        s0 = self.enc0(x)
        s1 = self.enc1(s0)
        return self.out(self.dec0(self.dec1(self.mid(s1), s1), s0))


def build():
    return UNet(), torch.randn(1, 3, 64, 64)


def loss_fn(output, inputs):
    return F.mse_loss(output, inputs[0])
