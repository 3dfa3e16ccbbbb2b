"""`--engine` on estimate, simulate and plan: the engine's memory recipe, recorded in the plan;
the top consumers of a configuration that does not fit; the winner flagged when nearly full."""
from __future__ import annotations

import json

import pytest

SPEC = "gpt:layers=4,hidden=256,heads=4,vocab=1024"
JOB = ("--model", SPEC, "--cluster", "a100-80g", "--gpus", "2", "--gbs", "8", "--seq", "256")


def test_estimate_engine_changes_the_memory_only(run_cli, without_eager_count):
    """Here (one data-parallel pair, no TP, PP or ZeRO gathers) every engine's overlap prices the
    step alike: megatron's compute is `generic`'s but for its unfused loss kernels, counted one pass
    at a time (`costing.loss_kernels`: 52 bytes a logit against the saved-bytes rule's 30), and its
    exposed gradient reduction less (a layer pays its share of a 40M-parameter DDP bucket's ring
    latency, `communication.megatron_bucket_scale`); meshplan's executor adds FSDP2's gradient
    copies (`state_memory.grad_copy_bytes_per_param`; its eager blocks' count, `eager_kernels`, set
    aside here: tested on its own); the memory follows each engine's recipe, `generic`'s the executor's."""
    code, out, err = run_cli("estimate", *JOB, "--json")
    assert code == 0, err
    own = json.loads(out)
    code, out, err = run_cli("estimate", *JOB, "--engine", "megatron", "--json")
    assert code == 0, err
    megatron = json.loads(out)
    code, out, err = run_cli("estimate", *JOB, "--engine", "generic", "--json")
    assert code == 0, err
    generic = json.loads(out)
    assert megatron["step_time_s"] < own["step_time_s"] and generic["step_time_s"] < own["step_time_s"]
    parts = {name: run["breakdown"] for name, run in (("generic", generic), ("megatron", megatron))}
    assert parts["generic"]["compute"] < parts["megatron"]["compute"]
    assert parts["megatron"]["dp_comm"] < parts["generic"]["dp_comm"]
    code, out, err = run_cli("estimate", *JOB, "--engine", "megatron", "--cross-entropy-fusion", "native", "--json")
    native = json.loads(out)  # 36 bytes a logit: between the two
    assert parts["generic"]["compute"] < native["breakdown"]["compute"] < parts["megatron"]["compute"]
    assert generic["memory_bytes"] == own["memory_bytes"]
    first = megatron["memory_bytes"][0]
    assert first["grads"] == 2 * first["params"]  # bf16 parameters, fp32 main_grad
    assert first["optimizer"] == 6 * first["params"]  # fp32 master weights and two moments, ZeRO-0
    assert own["memory_bytes"][0]["params"] != first["params"]  # FSDP2 keeps fp32 parameters and their bf16 copy
    code, out, err = run_cli("estimate", *JOB, "--engine", "torchtitan")
    assert code == 0, err
    assert "memory as torchtitan allocates it" in out


def test_estimate_names_the_top_consumers_when_it_does_not_fit(run_cli):
    code, out, err = run_cli("estimate", "--model", "llama3-8b", "--cluster", "a100-40g", "--gpus", "1", "--gbs", "1",
                             "--seq", "4096", "--engine", "megatron")
    assert code == 2 and "does not fit" in err, err
    assert "fits: NO" in out
    lines = out[out.index("top consumers"):].splitlines()[1:4]
    assert [line.split()[0] for line in lines] == ["optimizer", "grads", "activations"]  # 12, 4 and 2 bytes / param
    assert "--zero 1" in lines[0]


def test_top_consumers_name_only_levers_not_already_pulled(run_cli):
    """Under ZeRO-3 and full recomputation the remedies offer neither a ZeRO stage nor a
    recomputation: more data ranks shard the states further, offloading and model parallelism
    remain."""
    code, out, err = run_cli("estimate", "--model", "llama3-70b", "--cluster", "a100-40g", "--gpus", "8", "--gbs", "8",
                             "--seq", "4096", "--engine", "torchtitan", "--zero", "3", "--recompute", "full")
    assert code == 2 and "does not fit" in err, err
    lines = {line.split()[0]: line for line in out[out.index("top consumers"):].splitlines()[1:4]}
    assert "optimizer" in lines and "params" in lines
    assert "--zero" not in "".join(lines.values()) and "--recompute" not in "".join(lines.values())
    assert "more data ranks (--gpus)" in lines["optimizer"] and "--offload optimizer" in lines["optimizer"]
    assert "--offload params" in lines["params"]


def test_estimate_from_refuses_engine_meshplan(run_cli, tmp_path):
    config = tmp_path / "job.toml"
    config.write_text("[model]\nname = 'llama3'\n")
    code, out, err = run_cli("estimate", "--from", config, "--engine", "meshplan")
    assert code == 2 and "names its engine" in err


def test_plan_records_the_engine_and_simulate_reads_it(run_cli, tmp_path):
    from meshplan.planner.contracts.plan import load_plan, plan_from_json

    path = tmp_path / "plan.json"
    code, out, err = run_cli("plan", *JOB, "--engine", "deepspeed", "--top", "1", "--time-limit", "1", "--out", path)
    assert code == 0, err
    assert "memory as deepspeed allocates it" in out.splitlines()[0]
    data = json.loads(path.read_text())
    assert data["engine"] == "deepspeed" and load_plan(path).config.engine == "deepspeed"
    code, out, err = run_cli("simulate", "--plan", path, "--json")
    assert code == 0, err
    assert json.loads(out)["peak_memory_bytes"] == data["prediction"]["peak_memory_bytes"]
    code, out, err = run_cli("simulate", "--plan", path, "--engine", "megatron", "--json")
    assert code == 0, err
    assert json.loads(out)["peak_memory_bytes"] != data["prediction"]["peak_memory_bytes"]
    code, out, err = run_cli("simulate", "--plan", path)
    assert code == 0, err
    assert "memory as deepspeed allocates it" in out
    del data["engine"]  # a plan written before the key: meshplan's executor
    assert plan_from_json(data).config.engine == "meshplan"


def test_the_winner_is_flagged_nearly_full_like_the_others():
    from meshplan.planner.search.assembly import explain, memory_nearly_full

    gib = 2**30
    assert memory_nearly_full(76.7 * gib, 77.1 * gib) == "memory nearly full (76.7 of 77.1 GiB)"
    assert memory_nearly_full(60 * gib, 77.1 * gib) == ""
    plan = {"prediction": {"step_time_s": 1.0, "mfu": 0.4, "bubble_fraction": 0.0, "peak_memory_bytes": 76.7 * gib},
            "solver": {"usable_memory_bytes": 77.1 * gib}, "mesh": {"pp": 1, "dp": 8, "tp": 1}, "sp": False,
            "schedule": {"name": "1f1b", "virtual_stages": 1, "microbatches": 1, "microbatch_size": 1}, "zero": 1,
            "layers": []}
    assert "memory nearly full (76.7 of 77.1 GiB)" in explain(plan)


def test_estimate_memory_headroom(run_cli):
    code, out, err = run_cli("estimate", *JOB, "--memory-headroom", "70")
    assert code == 0, err
    assert "GiB of 7.67 GiB usable" in out  # 77.67 GiB usable on a100-80g less 70
    code, out, err = run_cli("estimate", *JOB, "--memory-headroom", "100")
    assert code == 2 and "--memory-headroom must be between 0 and the 77.67 GiB usable" in err


def test_plan_takes_megatrons_bf16_gradients_and_records_them(run_cli, tmp_path):
    """`plan --grad-reduce-in-bf16` plans every candidate with the bf16 gradient buffer: the plan
    records it, and its memory is what `estimate` gives its winner with the flag."""
    path = tmp_path / "plan.json"
    code, out, err = run_cli("plan", *JOB, "--engine", "megatron", "--grad-reduce-in-bf16", "--top", "1",
                             "--time-limit", "1", "--out", path)
    assert code == 0, err
    data = json.loads(path.read_text())
    assert data["grad_reduce_in_bf16"] is True
    mesh, schedule = data["mesh"], data["schedule"]
    args = ("--tp", str(mesh["tp"]), "--pp", str(mesh["pp"]), "--mbs", str(schedule["microbatch_size"]),
            "--zero", str(data["zero"]), "--engine", "megatron", "--json")
    code, out, err = run_cli("estimate", *JOB, *args, "--grad-reduce-in-bf16")
    assert code == 0, err
    estimated = json.loads(out)["memory_bytes"][0]
    assert estimated["grads"] == data["prediction"]["memory_bytes"][0]["grads"]
    code, out, err = run_cli("estimate", *JOB, *args)
    assert json.loads(out)["memory_bytes"][0]["grads"] == 2 * estimated["grads"]  # fp32 main_grad: twice


def test_plan_refuses_bf16_gradients_outside_megatron(run_cli):
    code, out, err = run_cli("plan", *JOB, "--grad-reduce-in-bf16")
    assert code == 2 and "--engine megatron" in err and "Traceback" not in err


def test_plan_takes_megatrons_fused_loss_and_records_it(run_cli, tmp_path):
    """`plan --cross-entropy-fusion te` plans every candidate with Transformer Engine's loss: the plan
    records it, its step time is what `estimate` gives the winner with the flag, and without the
    flag (Megatron-LM's unfused fp32 loss) the same layout is slower; other engines refuse it."""
    path = tmp_path / "plan.json"
    code, out, err = run_cli("plan", *JOB, "--engine", "megatron", "--cross-entropy-fusion", "te", "--top", "1",
                             "--time-limit", "1", "--out", path)
    assert code == 0, err
    data = json.loads(path.read_text())
    assert data["cross_entropy_fusion"] == "te"
    mesh, schedule = data["mesh"], data["schedule"]
    args = ("--tp", str(mesh["tp"]), "--pp", str(mesh["pp"]), "--mbs", str(schedule["microbatch_size"]),
            "--zero", str(data["zero"]), "--engine", "megatron", "--json") + (("--sp",) if data["sp"] else ())
    code, out, err = run_cli("estimate", *JOB, *args, "--cross-entropy-fusion", "te")
    assert code == 0, err
    fused_s = json.loads(out)["step_time_s"]
    assert fused_s == pytest.approx(data["prediction"]["step_time_s"], rel=1e-9)
    code, out, err = run_cli("estimate", *JOB, *args)
    assert json.loads(out)["step_time_s"] > fused_s
    code, out, err = run_cli("plan", *JOB, "--cross-entropy-fusion", "native")
    assert code == 2 and "--engine megatron" in err and "Traceback" not in err


def test_plan_says_what_a_fused_loss_would_save(run_cli):
    """Planned for megatron without --cross-entropy-fusion, a large-vocabulary model's plan names
    what Transformer Engine's loss kernel would take off the winner's step; with the flag it does not."""
    job = ("--model", "gpt:layers=2,hidden=256,heads=4,vocab=32768", "--cluster", "a100-80g", "--gpus", "2",
           "--gbs", "8", "--seq", "256", "--engine", "megatron", "--top", "1", "--time-limit", "1")
    code, out, err = run_cli("plan", *job)
    assert code == 0, err
    line = next(line for line in out.splitlines() if line.startswith("loss: Megatron-LM's unfused"))
    assert "--cross-entropy-fusion te" in line and "off the step" in line
    saved_ms = float(line.split(" takes ")[1].split(" ms")[0])
    code, out, err = run_cli("plan", *job, "--json")
    data = json.loads(out)
    mesh, schedule = data["mesh"], data["schedule"]
    layout = ("--model", job[1], "--cluster", "a100-80g", "--gpus", "2", "--gbs", "8", "--seq", "256",
              "--engine", "megatron", "--tp", str(mesh["tp"]), "--pp", str(mesh["pp"]),
              "--mbs", str(schedule["microbatch_size"]), "--zero", str(data["zero"]), "--json") + (
              ("--sp",) if data["sp"] else ())
    unfused, fused = (json.loads(run_cli("estimate", *layout, "--cross-entropy-fusion", name)[1])["step_time_s"]
                      for name in ("none", "te"))
    assert saved_ms == pytest.approx((unfused - fused) * 1e3, rel=5e-3)  # printed to 3 significant digits
    code, out, err = run_cli("plan", *job, "--cross-entropy-fusion", "te")
    assert code == 0, err
    assert "loss: " not in out


def test_a_plan_for_another_engine_says_who_runs_it(run_cli):
    """A mixture of experts under TP with SP: Megatron-LM runs it (it requires SP with TP and EP),
    meshplan's executor does not. Planned for megatron, the plan says to export it; planned for
    meshplan's executor (pinned), it is NOT EXECUTABLE."""
    moe = "moe:layers=2,hidden=64,heads=4,kv_heads=2,experts=4,top_k=2,expert_ffn=32,vocab=128"
    job = ("--model", moe, "--cluster", "a100-80g", "--gpus", "2", "--gbs", "8", "--seq", "256", "--tp", "2", "--sp",
           "--top", "1", "--time-limit", "1")
    code, out, err = run_cli("plan", *job, "--engine", "megatron")
    assert code == 0, err
    assert "planned for megatron (`meshplan export --to megatron` writes its job); meshplan's own `train` does " \
           "not run it: the executor runs mixture-of-experts blocks under tp=2 without sequence parallelism" in out
    code, out, err = run_cli("plan", *job)
    assert code == 0, err
    assert "NOT EXECUTABLE: the executor runs mixture-of-experts blocks under tp=2" in out


def test_tp_comm_overlap_flag_prices_and_records_the_tp_overlap(run_cli, tmp_path):
    """--tp-comm-overlap off under megatron: the TP collectives block (more exposed TP time, the
    overlap line says so); recorded in the plan and read back by simulate; an engine that cannot
    overlap them refuses `on` in one line."""
    job = ("--model", SPEC, "--cluster", "a100-80g", "--gpus", "2", "--gbs", "8", "--seq", "256", "--tp", "2", "--sp",
           "--engine", "megatron")
    default, blocking = (_estimate_json(run_cli, *job, *extra) for extra in ((), ("--tp-comm-overlap", "off")))
    assert blocking["overlap"]["tp_comm_overlap"] is False and default["overlap"]["tp_comm_overlap"] is True
    assert blocking["breakdown"]["tp_comm"] > default["breakdown"]["tp_comm"]
    code, out, err = run_cli("estimate", *job, "--tp-comm-overlap", "off")
    assert code == 0 and "TP comm blocking" in out, err
    path = tmp_path / "plan.json"
    code, out, err = run_cli("plan", *job, "--tp", "2", "--tp-comm-overlap", "off", "--top", "1", "--time-limit", "1",
                             "--out", path)
    assert code == 0, err
    assert json.loads(path.read_text())["tp_comm_overlap"] is False
    code, out, err = run_cli("simulate", "--plan", path, "--json")
    assert code == 0, err
    code, out, err = run_cli("estimate", *JOB, "--tp", "2", "--sp", "--tp-comm-overlap", "on")
    assert code == 2 and "meshplan runs its TP collectives on the compute stream" in err and err.count("\n") == 1


def _estimate_json(run_cli, *args) -> dict:
    code, out, err = run_cli("estimate", *args, "--json")
    assert code == 0, err
    return json.loads(out)


MOE_JOB = ("--model", "moe:layers=4,hidden=256,heads=4,kv_heads=2,experts=8,top_k=2,expert_ffn=256,vocab=1024",
           "--cluster", "h100-sxm", "--gpus", "16", "--gbs", "64", "--seq", "512", "--ep", "8", "--pp", "2",
           "--vpp", "2", "--schedule", "interleaved", "--zero", "1", "--engine", "megatron")


def test_estimate_moe_a2a_overlap_prices_megatron_s_combined_1f1b(run_cli):
    """--moe-a2a-overlap shortens the step by the all-to-alls it hides (`costing.moe_overlap`),
    says so in the overlap record and in a note naming what it leaves out, and is refused in one
    line where Megatron-LM has no such schedule (another engine; pipelining without virtual stages)."""
    code, out, err = run_cli("estimate", *MOE_JOB, "--json")
    assert code == 0, err
    blocking = json.loads(out)
    code, out, err = run_cli("estimate", *MOE_JOB, "--moe-a2a-overlap", "--json")
    assert code == 0, err
    paired = json.loads(out)
    assert paired["step_time_s"] < blocking["step_time_s"]
    assert paired["overlap"]["ep_a2a_paired"] is True and blocking["overlap"]["ep_a2a_paired"] is False
    assert "host-side cost" in err
    code, out, err = run_cli("estimate", *MOE_JOB[:-2], "--engine", "torchtitan", "--moe-a2a-overlap")
    assert code == 2 and "no combined 1F1B" in err and "Traceback" not in err
    code, out, err = run_cli("estimate", *MOE_JOB[:14], "--zero", "1", "--engine", "megatron", "--moe-a2a-overlap")
    assert code == 2 and "virtual stages > 1" in err, err


def test_plan_moe_a2a_overlap_is_recorded_in_the_plan(run_cli, tmp_path):
    """`plan --moe-a2a-overlap` turns the combined 1F1B on for the expert-parallel candidates that
    can run it; the plan file records it, and `export --to megatron` writes Megatron-LM's flag."""
    out_path = tmp_path / "plan.json"
    code, out, err = run_cli("plan", *MOE_JOB[:12], "--mbs", "1", "--engine", "megatron", "--moe-a2a-overlap",
                             "--out", str(out_path))
    assert code == 0, err
    data = json.loads(out_path.read_text())
    assert data["mesh"]["ep"] == 8 and data["moe_a2a_overlap"] is True
    code, out, err = run_cli("export", "--plan", str(out_path), "--to", "megatron")
    assert code == 0, err
    assert "--overlap-moe-expert-parallel-comm" in out
    # simulated under an engine without the schedule, the plan's all-to-alls block again: slower
    # (micro-batches of 1, so the forwards and backwards pair)
    code, out, err = run_cli("simulate", "--plan", str(out_path), "--json")
    assert code == 0, err
    paired = json.loads(out)["step_time_s"]
    code, out, err = run_cli("simulate", "--plan", str(out_path), "--engine", "generic", "--json")
    assert code == 0, err
    assert json.loads(out)["step_time_s"] > paired


def test_estimate_says_where_full_recomputation_stops_early(run_cli):
    """Under an engine whose full recomputation is torch's non-reentrant checkpoint (meshplan's
    executor, torchtitan) `estimate` says its recompute time leaves the down projections out, and
    that time is below Megatron-Core's, which reruns the whole forward; under megatron it says nothing."""
    times = {}
    for engine in ("torchtitan", "meshplan", "megatron"):
        code, out, err = run_cli("estimate", *JOB, "--recompute", "full", "--engine", engine)
        assert code == 0, err
        line = next(line for line in out.splitlines() if line.strip().startswith("recompute"))
        assert ("early stop" in line) == (engine != "megatron"), line
        code, out, err = run_cli("estimate", *JOB, "--recompute", "full", "--engine", engine, "--json")
        times[engine] = json.loads(out)["breakdown"]["recompute"]
    assert times["torchtitan"] < times["megatron"]


def test_recompute_early_stop_flag_turns_the_engines_rule_off_and_on(run_cli, tmp_path):
    """--recompute-early-stop off prices torchtitan's full recomputation as the whole forward
    (torch 2.0 or set_checkpoint_early_stop(False)): Megatron-Core's recompute time, where the
    estimate then says nothing of an early stop; on under generic stops early as torchtitan does;
    a plan written with it keeps it (plan.json `recompute_early_stop`) and simulates alike; on
    under megatron, or without --recompute full, is refused in one line (exit 2)."""
    def recompute_s(*flags):
        code, out, err = run_cli("estimate", *JOB, "--recompute", "full", *flags, "--json")
        assert code == 0, err
        return json.loads(out)["breakdown"]["recompute"]

    whole = recompute_s("--engine", "megatron")
    assert recompute_s("--engine", "torchtitan", "--recompute-early-stop", "off") == pytest.approx(whole, rel=1e-9)
    assert recompute_s("--engine", "generic", "--recompute-early-stop", "on") == pytest.approx(
        recompute_s("--engine", "torchtitan"), rel=1e-9)
    code, out, err = run_cli("estimate", *JOB, "--recompute", "full", "--engine", "torchtitan",
                             "--recompute-early-stop", "off")
    assert code == 0 and "early stop" not in out, err
    for flags, says in ((("--recompute", "full", "--engine", "megatron", "--recompute-early-stop", "on"), "reentrant"),
                        (("--recompute-early-stop", "off"), "add --recompute full")):
        code, out, err = run_cli("estimate", *JOB, *flags)
        assert code == 2 and says in err and "Traceback" not in err, err
    plan_path = tmp_path / "plan.json"
    code, out, err = run_cli("plan", *JOB, "--recompute", "full", "--recompute-early-stop", "off", "--out",
                             str(plan_path))
    assert code == 0, err
    written = json.loads(plan_path.read_text())
    assert written["recompute_early_stop"] is False
    code, out, err = run_cli("simulate", "--plan", str(plan_path), "--json")
    assert code == 0, err
    assert json.loads(out)["breakdown"]["recompute"] == pytest.approx(written["prediction"]["breakdown"]["recompute"],
                                                                       rel=1e-9)


def test_estimate_and_plan_price_the_kernel_the_engine_runs(run_cli, tmp_path):
    """Without --attention a job is priced on the kernel its engine runs (`engine_attention`), as
    `estimate --from` prices an engine's file: Megatron-Core's Transformer Engine picks cuDNN's fused
    attention on Hopper, which the estimate names and which is faster on an H100 than torch SDPA's
    flash kernel (meshplan's own, named by nobody); --attention overrides it."""
    job = ("--model", SPEC, "--cluster", "h100-sxm", "--gpus", "2", "--gbs", "8", "--seq", "2048")
    step = {}
    for name, extra in (("megatron", ("--engine", "megatron")),
                        ("cudnn", ("--engine", "megatron", "--attention", "cudnn")),
                        ("flash", ("--engine", "megatron", "--attention", "flash")),
                        ("own", ())):
        code, out, err = run_cli("estimate", *job, *extra, "--json")
        assert code == 0, err
        step[name] = json.loads(out)["step_time_s"]
        assert ("attention: cudnn, megatron's default kernel (--attention to change it)" in err) == (name == "megatron")
    assert step["megatron"] == step["cudnn"] < step["flash"]
    code, out, err = run_cli("estimate", *job, "--engine", "llm-foundry", "--json")
    assert code == 0 and "attention: flash2, llm-foundry's default kernel" in err
    path = tmp_path / "plan.json"
    code, out, err = run_cli("plan", *job, "--engine", "megatron", "--top", "1", "--time-limit", "1", "--out", path)
    assert code == 0, err
    assert "attention: cudnn, megatron's default kernel" in err
    assert json.loads(path.read_text())["model"]["attention"] == "cudnn"


def test_the_engine_kernel_note_says_what_it_is_costed_as_off_hopper(run_cli):
    """On an A100 the note still names the engine's kernel and says it is costed as FlashAttention-2
    (cuDNN has no published figure off Hopper, `attention_kernels.kernel_speed`): the same time as
    naming flash2."""
    job = ("--model", SPEC, "--cluster", "a100-80g", "--gpus", "2", "--gbs", "8", "--seq", "2048", "--engine", "megatron")
    code, out, err = run_cli("estimate", *job, "--json")
    assert code == 0, err
    assert "attention: cudnn, megatron's default kernel, costed as flash2 on this device" in err
    code, out2, err = run_cli("estimate", *job, "--attention", "flash2", "--json")
    assert code == 0 and "default kernel" not in err
    assert json.loads(out)["step_time_s"] == json.loads(out2)["step_time_s"]


def test_estimate_says_what_torchtitans_op_policy_reruns(run_cli):
    """Under --engine torchtitan, --recompute selective is its per-op policy (`costing.torchtitan_sac`):
    the recompute line says what it reruns, every other Linear under fp8 as in bf16 (the policy sees a
    Float8 Linear's product as `aten.mm`); other engines say nothing."""
    for engine, flags, says in (("torchtitan", (), "every other matmul"),
                                ("torchtitan", ("--cluster", "h100-sxm", "--precision", "fp8"),
                                 "every other matmul, Float8 alike"),
                                ("megatron", (), None)):
        code, out, err = run_cli("estimate", *JOB, "--recompute", "selective", "--engine", engine, *flags)
        assert code == 0, err
        line = next(line for line in out.splitlines() if line.strip().startswith("recompute"))
        assert (says in line) if says else "op policy" not in line, line
