"""Convolutions are costed apart from GEMMs: the profiler records their FLOPs per layer, the cost
model charges them at the device's `conv_efficiency`, and `calibrate` fits that factor."""
from __future__ import annotations

from dataclasses import replace

import pytest

MODEL = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.act = nn.ReLU()
        self.fc = nn.Linear(8 * 16 * 16, 10)

    def forward(self, x):
        return self.fc(self.act(self.conv(x)).flatten(1))


def build():
    return Net(), torch.randn(1, 3, 16, 16)
'''
CONV_FWD = 2 * 8 * 3 * 9 * 16 * 16  # 2 x output elements x (in channels x kernel area)
FC_FWD = 2 * 8 * 16 * 16 * 10


def _graph(tmp_path):
    from meshplan.planner.profiling.profiler import profile

    path = tmp_path / "net.py"
    path.write_text(MODEL)
    return profile(f"{path}:build", 1, dtype="fp32", cache=False)


def test_profiler_records_convolution_flops_per_layer(tmp_path):
    layers = {layer.name: layer for layer in _graph(tmp_path).layers}
    conv, fc = layers["conv"], layers["fc"]
    assert conv.fwd_flops == conv.conv_fwd_flops == CONV_FWD
    # the image needs no gradient: the backward computes only the weight gradient
    assert conv.bwd_flops == conv.conv_bwd_flops == CONV_FWD
    assert fc.conv_fwd_flops == fc.conv_bwd_flops == 0 and fc.fwd_flops == FC_FWD
    assert layers["act"].conv_fwd_flops == 0


def test_zoo_layers_have_no_convolution_flops():
    from meshplan.planner.profiling.profiler import profile

    graph = profile("gpt:layers=2,hidden=64,heads=4,vocab=128", 32, dtype="fp32", trace=True, cache=False)
    assert all(layer.conv_fwd_flops == layer.conv_bwd_flops == 0 for layer in graph.layers)


def test_convolutions_cost_their_efficiency(tmp_path):
    from meshplan.planner.contracts.config import ParallelConfig
    from meshplan.planner.costing.device_time import compute_time_s
    from meshplan.planner.costing.hardware import load_cluster
    from meshplan.planner.costing.layer_cost import layer_cost
    from meshplan.planner.costing.uniform import layer_config

    graph = _graph(tmp_path)
    conv = next(layer for layer in graph.layers if layer.name == "conv")
    base = load_cluster("cpu")
    strategy = layer_config(ParallelConfig(gpus=1, global_batch=4, microbatch_size=4, precision="fp32"))
    times = {}
    for efficiency in (1.0, 0.5):
        cluster = replace(base, device=replace(base.device, conv_efficiency=efficiency,
                                               elementwise_bytes_per_activation_byte=0.0))
        cost = layer_cost(conv, strategy, cluster, graph.info, profile_dtype="fp32")
        times[efficiency] = cost.fwd_compute_s
    gemm_s = compute_time_s(4 * CONV_FWD, 1, base, "fp32", num_launches=0)
    # halving the efficiency doubles the convolution's GEMM-curve time, nothing else
    assert times[0.5] - times[1.0] == pytest.approx(gemm_s, rel=1e-9)


def test_conv_efficiency_fit_is_the_gemm_curve_time_over_the_measured():
    from meshplan.planner.calibration.fits import fit_conv_efficiency, probe_profile
    from meshplan.planner.costing.device_time import compute_time_s
    from meshplan.planner.costing.hardware import load_cluster

    device = load_cluster("cpu").device
    cluster = probe_profile(device)
    samples = []
    for fwd, factor in ((4e8, 0.6), (8e8, 0.7), (2e8, 0.8)):
        curve_s = compute_time_s(fwd, 1, cluster, "fp32", num_launches=0) + compute_time_s(
            2 * fwd, 2, cluster, "fp32", num_launches=0)
        samples.append((fwd, 2 * fwd, curve_s / factor))
    assert fit_conv_efficiency(samples, device, "fp32") == pytest.approx(0.7)  # the median
    assert fit_conv_efficiency([(1e8, 2e8, 1e-9)], device, "fp32") == 1.0  # capped: never faster than a GEMM


def test_profile_rejects_a_conv_efficiency_outside_zero_one():
    from meshplan.planner.costing.hardware import load_cluster

    device = load_cluster("cpu").device
    with pytest.raises(ValueError, match="conv_efficiency"):
        replace(device, conv_efficiency=1.5)
