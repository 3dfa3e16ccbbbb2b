"""`meshplan calibrate`: measure this machine into a cluster profile TOML the other commands accept,
with the topology the user states (nodes, GPUs and NICs per node) and the inter-node fabric fitted
to imported nccl-tests runs."""
from __future__ import annotations

import sys
from pathlib import Path


def add_arguments(parser) -> None:
    parser.add_argument("--nproc", type=int, default=2, help="processes to measure with: one per GPU (1 measures one GPU alone, its links taken from the base profile); CPU: 2 or more local processes")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                        help="gloo (CPU processes) or nccl (CUDA GPUs); default nccl when CUDA is available")
    parser.add_argument("-o", "--out", required=True, help="TOML file to write")
    runs = parser.add_argument_group(
        "your own runs", "fit the profile's efficiency fields to runs you measured instead of measuring this machine")
    runs.add_argument("--from-runs", nargs="+", default=None, metavar="CONFIG,MEASURED",
                      help="runs as an engine config (or plan.json) and its measured.json or training log, joined "
                           "by a comma; leave-one-out cross-validation is printed and the fit set recorded")
    runs.add_argument("--cluster", default=None, help="with --from-runs: the profile of the GPUs the runs used")
    runs.add_argument("--model", default=None, help="with --from-runs: model SPEC of configs that name none")
    runs.add_argument("--seq", type=int, default=None, help="with --from-runs: sequence length of configs without one")
    parser.add_argument("--name", default=None, help="profile name (default: the file's stem)")
    parser.add_argument("--base", default=None,
                        help="profile whose peaks and unmeasured fields to start from (default cpu / matching GPU)")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repetitions (a rough profile in seconds)")
    topology = parser.add_argument_group(
        "the cluster you have", "calibrate measures one node; state the rest, and import nccl-tests runs across nodes "
        "for the fabric between them")
    topology.add_argument("--nodes", type=int, default=None, help="nodes in the cluster (the profile's max_nodes)")
    topology.add_argument("--gpus-per-node", type=int, default=None,
                          help="GPUs per node (default: --nproc, the processes measured on this node)")
    topology.add_argument("--nics-per-node", type=int, default=None,
                          help="inter-node NICs (rails) per node, e.g. 8 on DGX A100/H100 (default: the base's)")
    topology.add_argument("--nccl-tests", action="append", default=[], metavar="FILE",
                          help="stdout of nccl-tests' all_reduce_perf / all_gather_perf / reduce_scatter_perf run "
                               "across 2 or more nodes (repeatable): the inter-node NIC bandwidth and latency are "
                               "fitted to its table; 3+ nodes or NCCL_ALGO=Ring give the fabric's own figure")
    topology.add_argument("--no-measure", action="store_true",
                          help="measure nothing here: start from --base and apply only the topology and imports")


def run(args) -> int:
    from meshplan.planner.calibration.fabric import apply_topology, check_topology, import_nccl_tests
    from meshplan.planner.calibration.nccl_tests import read_nccl_tests
    from meshplan.planner.contracts.atomicfile import write_text_atomic
    from meshplan.planner.contracts.errors import MeshplanError
    from meshplan.planner.contracts.cluster import dump_cluster_toml
    from meshplan.planner.costing.hardware import load_cluster
    from meshplan.planner.contracts.atomicfile import refuse_output_over_input

    run_files = [path for item in args.from_runs or () for path in item.rsplit(",", 1)]
    refuse_output_over_input("--out", args.out, [("--base", args.base),
                                                 *(("--nccl-tests", path) for path in args.nccl_tests),
                                                 *(("--from-runs", path) for path in run_files)])
    out = Path(args.out)
    if out.suffix != ".toml":
        raise MeshplanError(f"--out must name a .toml file, got {args.out!r}")
    if not out.parent.exists():
        raise MeshplanError(f"directory {out.parent} does not exist; create it or pick another --out")
    if args.from_runs:
        from meshplan.commands.calibrate_runs import run_from_runs

        return run_from_runs(args)
    # Refuse a bad topology or a malformed nccl-tests file before minutes of measuring.
    measured_ranks = None if args.no_measure else args.nproc
    check_topology(args.nodes, args.gpus_per_node, args.nics_per_node, measured_ranks)
    runs = [read_nccl_tests(path) for path in args.nccl_tests]
    profile = _measured_or_base(args, out.stem)
    busy = "" if args.no_measure else _busy_note(args.nproc)
    if busy:  # the wall-clock parts (collectives, fixed costs) read slow: say so in the profile too
        from dataclasses import replace

        profile = replace(profile, source=f"{profile.source}; measured on a busy host ({busy})")
    from meshplan.planner.calibration.host import noisy_rounds

    noisy = [] if args.no_measure or profile.calibration is None else noisy_rounds(profile.calibration)
    profile = apply_topology(profile, args.nodes, args.gpus_per_node, args.nics_per_node, measured_ranks)
    notes: list[str] = []
    if runs:
        profile, notes = import_nccl_tests(profile, runs, stated_nodes=args.nodes)
    write_text_atomic(out, "# Written by meshplan calibrate; every measured field's source says how.\n"
                      + dump_cluster_toml(profile), "--out")
    load_cluster(out)  # what we wrote must load
    _print_summary(out, profile, args, notes)
    for note in noisy:
        print(f"meshplan calibrate: warning: {note}: the machine's speed changed while measuring; the report will not "
              "judge runs by this profile: calibrate again on a quiet machine", file=sys.stderr)
    if busy:
        print(f"meshplan calibrate: warning: the machine was busy while measuring ({busy}); the link and the "
              "fixed costs, timed in wall-clock time, read slow: calibrate again on a quiet machine", file=sys.stderr)
    return 0


def _busy_note(nproc: int) -> str:
    """`calibration.host.busy_host` on the last minute's load average, right after the measurement."""
    import os

    from meshplan.planner.calibration.host import busy_host

    if not hasattr(os, "getloadavg"):
        return ""
    return busy_host(os.getloadavg()[0], os.cpu_count() or 1, nproc)


def _measured_or_base(args, stem: str):
    from meshplan.planner.calibration.runner import calibrate
    from meshplan.planner.contracts.errors import MeshplanError
    from meshplan.planner.costing.hardware import load_cluster

    if args.no_measure:
        if not args.base:
            raise MeshplanError("--no-measure starts from --base: name the profile to start from, e.g. --base h100-sxm")
        from dataclasses import replace

        return replace(load_cluster(args.base), name=args.name or stem)
    backend = args.backend
    if backend is None:
        import torch

        backend = "nccl" if torch.cuda.is_available() else "gloo"
    return calibrate(nproc=args.nproc, backend=backend, quick=args.quick, name=args.name or stem, base=args.base,
                     progress=True)  # a bar only when stderr is a terminal


def _print_summary(out, profile, args, notes: list[str]) -> None:
    device, link, fabric = profile.device, profile.intra_node, profile.inter_node
    processes = "profile" if args.no_measure else f"{args.nproc} x"
    print(f"wrote {out}: {processes} {device.name}; {profile.max_nodes} nodes x {profile.gpus_per_node} GPUs, "
          f"{profile.nics_per_node} NICs per node")
    print(f"  matmul     {device.peak_flops(next(iter(device.peak_flops_per_s))) * device.matmul_efficiency / 1e9:10.1f} "
          f"GFLOP/s large, half efficiency at {device.matmul_half_efficiency_flops / 1e6:.2f} MFLOP; "
          f"convolutions at {device.conv_efficiency:.2f} of it")
    print(f"  memory     {device.memory_bw_bytes_per_s / 1e9:10.1f} GB/s, {device.memory_bytes / 2**30:.1f} GiB per process")
    print(f"  per layer  {device.kernel_overhead_s * 1e6:10.1f} us fixed overhead, "
          f"{device.elementwise_bytes_per_activation_byte:.1f} bytes of elementwise traffic per saved byte")
    kinds = "".join(f", {kind} x{value:.2f}" for kind, value in sorted(link.kind_efficiency.items()))
    print(f"  link       {link.bw_bytes_per_s / 1e9:10.2f} GB/s, latency {link.latency_s * 1e6:.1f} us{kinds}")
    print(f"  per NIC    {fabric.bw_bytes_per_s * fabric.efficiency / 1e9:10.2f} GB/s, latency "
          f"{fabric.latency_s * 1e6:.1f} us ({'fitted to nccl-tests' if args.nccl_tests else 'from the base profile'})")
    print(f"  optimizer  {profile.optimizer_bytes_per_param:10.1f} bytes/param, {device.optimizer_per_tensor_s * 1e6:.0f} us "
          f"per tensor ({device.dtensor_optimizer_per_tensor_s * 1e6:.0f} us as DTensor)")
    print(f"  fixed      {device.tp_layer_overhead_s * 1e6:10.0f} us per TP layer pass, {device.dp_unit_overhead_s * 1e6:.0f} us "
          f"per FSDP layer pass, {device.pipeline_action_overhead_s * 1e6:.0f} us per pipeline action")
    print(f"  TP extra   {device.tp_overhead_s_per_stream_byte * 1e9:10.2f} ns per residual-stream byte, "
          f"{device.sp_layer_overhead_s * 1e6:.0f} us per sequence-parallel block pass, "
          f"{device.tp_loss_overhead_s * 1e6:.0f} us per vocab-parallel loss")
    print(f"  FSDP extra {device.dp_overhead_s_per_byte * 1e9:10.2f} ns per byte gathered or reduced")
    if profile.calibration is not None and not args.no_measure:
        c = profile.calibration
        print(f"  clock      {c.processes} process(es) x {c.threads_per_process} thread(s), {c.dtype}, {c.rounds} rounds: "
              f"compute by {c.compute_clock} (spread {c.compute_spread:.0%}), link by {c.link_clock} (spread "
              f"{c.link_spread:.0%}), load average {c.load_avg_1m:.1f} on {c.num_cpus} CPU(s)")
    for note in notes:
        print(f"  note: {note}")
