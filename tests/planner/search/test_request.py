"""`PlanRequest`: built from `search_plan`'s keywords, validated once with the numbers in the
message, and validated again when a field is replaced (the CLI's sizing plans other GPU counts)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.costing.hardware import load_cluster
from meshplan.planner.search.candidates import Pins
from meshplan.planner.search.request import PlanRequest

SPEC = "gpt:layers=2,hidden=64,heads=4,vocab=128"


def test_of_splits_fields_from_pins_and_resolves_defaults():
    request = PlanRequest.of(SPEC, "h100-sxm", 16, 32, 64, top_k=3, tp=2, zero=1, workers=1)
    assert request.cluster.name == load_cluster("h100-sxm").name
    assert request.pins == Pins(tp=2, zero=1)
    assert (request.top_k, request.workers, request.seq, request.precision) == (3, 1, 64, "bf16-mixed")
    assert request.num_keep == 6  # max(2 * 3, 6)
    assert replace(request, top_k=5).num_keep == 10 and replace(request, num_rerank=4).num_keep == 4
    assert PlanRequest.of(SPEC, "cpu", 4, 16).precision == "fp32"  # the cpu profile computes fp32 fastest
    pinned = Pins(pp=2)
    assert PlanRequest.of(SPEC, "h100-sxm", 16, 32, pins=pinned, tp=2).pins == pinned  # `pins` wins
    with pytest.raises(TypeError, match="colour"):
        PlanRequest.of(SPEC, "h100-sxm", 16, 32, colour=2)  # neither a field nor a pin


@pytest.mark.parametrize("change,message", [
    ({"gpus": 0}, "--gpus must be a positive integer, got 0"),
    ({"global_batch": 2.5}, "--gbs must be a positive integer, got 2.5"),
    ({"top_k": True}, "--top must be a positive integer, got True"),
    ({"gpus": 40000}, "--gpus 40000 exceeds the 32768 GPUs of cluster 'h100-sxm' (4096 nodes x 8); use at most 32768"),
    ({"memory_headroom_bytes": 100 * 2**30}, "between 0 and the 76.85 GiB usable per GPU on H100 SXM5 80GB, got 100 GiB"),
])
def test_bad_requests_say_the_numbers(change, message):
    request = PlanRequest.of(SPEC, "h100-sxm", 16, 32)
    with pytest.raises(MeshplanError) as err:
        replace(request, **change)
    assert message in str(err.value)


def test_fp8_needs_a_device_with_fp8():
    with pytest.raises(MeshplanError, match="no FP8 tensor cores"):
        PlanRequest.of(SPEC, "a100-80g", 8, 32, precision="fp8")
    assert PlanRequest.of(SPEC, "h100-sxm", 8, 32, precision="fp8").precision == "fp8"


def test_headroom_is_reserved_on_the_planning_cluster_only():
    request = PlanRequest.of(SPEC, "h100-sxm", 16, 32, memory_headroom_bytes=2 * 2**30)
    device, planned = request.cluster.device, request.planning_cluster.device
    assert planned.reserved_memory_bytes == device.reserved_memory_bytes + 2 * 2**30
    assert planned.usable_memory_bytes == device.usable_memory_bytes - 2 * 2**30
    plain = replace(request, memory_headroom_bytes=0.0)
    assert plain.planning_cluster is plain.cluster
