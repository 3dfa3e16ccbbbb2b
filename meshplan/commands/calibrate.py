"""`meshplan calibrate`: measure this machine into a cluster profile TOML the other commands accept."""
from __future__ import annotations

from pathlib import Path


def add_arguments(parser) -> None:
    parser.add_argument("--nproc", type=int, default=2, help="processes to measure with (one per GPU; CPU: local processes)")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                        help="gloo (CPU processes) or nccl (CUDA GPUs); default nccl when CUDA is available")
    parser.add_argument("--out", required=True, help="TOML file to write")
    parser.add_argument("--name", default=None, help="profile name (default: the file's stem)")
    parser.add_argument("--base", default=None,
                        help="profile whose peaks and unmeasured fields to start from (default cpu / matching GPU)")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repetitions (a rough profile in seconds)")


def run(args) -> int:
    from meshplan.planner.calibration.runner import calibrate
    from meshplan.planner.contracts.errors import MeshplanError
    from meshplan.planner.contracts.cluster import dump_cluster_toml
    from meshplan.planner.costing.hardware import load_cluster

    out = Path(args.out)
    if out.suffix != ".toml":
        raise MeshplanError(f"--out must name a .toml file, got {args.out!r}")
    if not out.parent.exists():
        raise MeshplanError(f"directory {out.parent} does not exist; create it or pick another --out")
    backend = args.backend
    if backend is None:
        import torch

        backend = "nccl" if torch.cuda.is_available() else "gloo"
    profile = calibrate(nproc=args.nproc, backend=backend, quick=args.quick, name=args.name or out.stem,
                        base=args.base)
    out.write_text("# Written by meshplan calibrate; every measured field's source says how.\n" + dump_cluster_toml(profile))
    load_cluster(out)  # what we wrote must load
    device, link = profile.device, profile.intra_node
    print(f"wrote {out}: {args.nproc} x {device.name}")
    print(f"  matmul     {device.peak_flops(next(iter(device.peak_flops_per_s))) * device.matmul_efficiency / 1e9:10.1f} "
          f"GFLOP/s large, half efficiency at {device.matmul_half_efficiency_flops / 1e6:.2f} MFLOP")
    print(f"  memory     {device.memory_bw_bytes_per_s / 1e9:10.1f} GB/s, {device.memory_bytes / 2**30:.1f} GiB per process")
    print(f"  per layer  {device.kernel_overhead_s * 1e6:10.1f} us fixed overhead, "
          f"{device.elementwise_bytes_per_activation_byte:.1f} bytes of elementwise traffic per saved byte")
    print(f"  link       {link.bw_bytes_per_s / 1e9:10.2f} GB/s, latency {link.latency_s * 1e6:.1f} us")
    print(f"  optimizer  {profile.optimizer_bytes_per_param:10.1f} bytes/param, {device.optimizer_per_tensor_s * 1e6:.0f} us "
          f"per tensor ({device.dtensor_optimizer_per_tensor_s * 1e6:.0f} us as DTensor)")
    print(f"  fixed      {device.tp_layer_overhead_s * 1e6:10.0f} us per TP layer pass, {device.dp_unit_overhead_s * 1e6:.0f} us "
          f"per FSDP layer pass, {device.pipeline_action_overhead_s * 1e6:.0f} us per pipeline action")
    print(f"  TP extra   {device.tp_overhead_s_per_stream_byte * 1e9:10.2f} ns per residual-stream byte, "
          f"{device.sp_layer_overhead_s * 1e6:.0f} us per sequence-parallel block pass, "
          f"{device.tp_loss_overhead_s * 1e6:.0f} us per vocab-parallel loss")
    return 0
