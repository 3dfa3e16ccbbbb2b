"""ViT-B/16 (Dosovitskiy et al. 2021): 224 x 224 images in 16 x 16 patches, 12 encoder blocks of
width 768 with 12 heads and a 3072-wide MLP, a class token and a 1000-class head (86M parameters).
A file model for planning image models with large micro-batches.

    meshplan plan --model benchmarks/models/vit_b16.py:build --cluster h100-sxm --gpus 8 --gbs 4096 --seq 1
"""
import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int, heads: int, mlp: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, mlp)
        self.fc2 = nn.Linear(mlp, width)

    def forward(self, x):
        batch, tokens, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, tokens, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch, tokens, width)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class VisionTransformer(nn.Module):
    def __init__(self, image: int = 224, patch: int = 16, width: int = 768, depth: int = 12, heads: int = 12,
                 mlp: int = 3072, num_classes: int = 1000):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, width, patch, patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, width))
        self.pos_embed = nn.Parameter(torch.zeros(1, (image // patch) ** 2 + 1, width))
        self.blocks = nn.Sequential(*(Block(width, heads, mlp) for _ in range(depth)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x, labels=None):  # labels: the loss's input, fed with the images
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


def build():
    return VisionTransformer(), (torch.randn(1, 3, 224, 224), torch.randint(0, 1000, (1,)))


def loss_fn(output, inputs):
    return F.cross_entropy(output, inputs[1])
