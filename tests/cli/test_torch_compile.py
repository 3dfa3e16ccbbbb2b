"""torch.compile under `--engine torchtitan` (`ParallelConfig.torch_compile`, `--compile`): what it
prices (torchao's Float8 input and output-gradient casts fused with the op before them: one bf16
read fewer per value, the weight casts unchanged), where it is refused, and how it travels
(plan.json `torch_compile`, the torchtitan TOML's `[compile]` / `training.compile`).

Expected values are the cast traffic by hand at the profile's achieved bandwidth; tolerance 1e-9
relative (floating point only)."""
from __future__ import annotations

import json

import pytest

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.costing import fp8
from meshplan.planner.costing.device_time import memory_time_s
from meshplan.planner.costing.hardware import load_cluster

SPEC = "llama:layers=2,hidden=1024,heads=8,kv_heads=8,ffn=2816,vocab=4096"
JOB = ("--model", SPEC, "--cluster", "h100-sxm", "--gpus", "8", "--gbs", "16", "--seq", "2048", "--zero", "3")


def test_fused_casts_lose_one_bf16_read_on_inputs_and_gradients_only():
    h100 = load_cluster("h100-sxm")
    values = (3e8, 5e7, 4e8)  # inputs, weights, output gradients
    for name, recipe in fp8.RECIPES.items():
        eager_fwd, eager_bwd = fp8.cast_times_s(recipe, values, 1.0, h100)
        fused_fwd, fused_bwd = fp8.cast_times_s(recipe, values, 1.0, h100, fused=True)
        assert eager_fwd - fused_fwd == pytest.approx(memory_time_s(2 * values[0], h100), rel=1e-9), name
        assert eager_bwd - fused_bwd == pytest.approx(memory_time_s(2 * values[2], h100), rel=1e-9), name


def test_only_torchtitan_compiles():
    config = ParallelConfig(gpus=8, global_batch=8, dp=8, engine="torchtitan", torch_compile=True)
    assert config.torch_compile
    for engine in ("megatron", "meshplan", "deepspeed"):
        with pytest.raises(ValueError, match="torchtitan's training.compile"):
            ParallelConfig(gpus=8, global_batch=8, dp=8, engine=engine, torch_compile=True)


def test_compile_prices_fp8_casts_fused_and_travels_in_the_plan(run_cli, tmp_path):
    def step(*flags):
        code, out, err = run_cli("estimate", *JOB, "--engine", "torchtitan", *flags, "--json")
        assert code == 0, err
        return json.loads(out)["step_time_s"]

    assert step("--compile") < step()  # bf16: the Llama blocks' elementwise kernels fused, not op by op
    assert step("--precision", "fp8", "--compile") < step("--precision", "fp8")
    code, out, err = run_cli("estimate", *JOB, "--engine", "megatron", "--compile")
    assert code == 2 and "--engine torchtitan" in err and "Traceback" not in err, err
    plan_path = tmp_path / "plan.json"
    code, out, err = run_cli("plan", *JOB, "--engine", "torchtitan", "--precision", "fp8", "--compile",
                             "--out", str(plan_path))
    assert code == 0, err
    written = json.loads(plan_path.read_text())
    assert written["torch_compile"] is True
    code, out, err = run_cli("simulate", "--plan", str(plan_path), "--json")
    assert code == 0, err
    assert json.loads(out)["step_time_s"] == pytest.approx(written["prediction"]["step_time_s"], rel=1e-9)
    toml_path = tmp_path / "job.toml"
    code, out, err = run_cli("export", "--plan", str(plan_path), "--to", "torchtitan", "--out", str(toml_path))
    assert code == 0, err
    assert "[compile]" in toml_path.read_text()
    code, out, err = run_cli("estimate", "--from", str(toml_path), "--cluster", "h100-sxm", "--gpus", "8", "--json")
    assert code == 0, err
    assert "torch.compile priced as its Float8 casts fused" in err
    assert json.loads(out)["step_time_s"] == pytest.approx(written["prediction"]["step_time_s"], rel=1e-6)


def test_estimate_without_compile_under_torchtitan_hints_the_compiled_step(run_cli):
    """Under torchtitan without --compile, `estimate` names the compiled step, `estimate --compile`'s
    own (to the printed 0.1 ms), and why: elementwise kernels fused and, under fp8, the Float8
    Linears' shared casts; the loss compiled with the model moving fewer bytes a logit; no hint once
    compiled, nor under an engine that does not compile."""
    def run(*flags):
        code, out, err = run_cli("estimate", *JOB, *flags)
        assert code == 0, err
        return out

    loss = "; its compiled loss moves 8 bytes a logit, where the eager one moves 48 to 76"  # loss_kernels' counts
    for precision, why in (("bf16-mixed", "it fuses the blocks' elementwise kernels" + loss),
                           ("fp8", "it fuses the blocks' elementwise kernels and casts each shared Float8 Linear "
                                   "input once (eagerly each Linear casts its own, forward and again backward)" + loss)):
        flags = ("--engine", "torchtitan", "--precision", precision)
        code, out, err = run_cli("estimate", *JOB, *flags, "--compile", "--json")
        compiled_s = json.loads(out)["step_time_s"]
        hint = run(*flags).strip().splitlines()[-1]
        assert hint.startswith(f"hint: --compile (torch.compile, torchtitan's training.compile) gives "
                               f"{compiled_s * 1e3:.1f} ms per step"), hint
        assert hint.endswith(why), hint
        assert "hint: --compile" not in run(*flags, "--compile")
    assert "hint: --compile" not in run("--engine", "megatron")


@pytest.mark.parametrize("vocab", [4096, 65536])  # the larger: the compiled loss's memory named too
def test_plan_without_compile_under_torchtitan_says_what_compile_takes_off(run_cli, tmp_path, vocab):
    """`plan` under torchtitan without --compile: the line's saving is the plan's step less the same
    plan simulated with `torch_compile` (its plan.json with the key set), to the printed 3 digits,
    and its peak memory likewise where `saves_memory` names it (to the printed 0.1 GiB); no line
    once planned compiled."""
    import re

    job = ("--model", SPEC.replace("vocab=4096", f"vocab={vocab}"), *JOB[2:])
    plan_path, compiled_path = tmp_path / "plan.json", tmp_path / "compiled.json"
    code, out, err = run_cli("plan", *job, "--engine", "torchtitan", "--out", str(plan_path))
    assert code == 0, err
    line = next(line for line in out.splitlines() if line.startswith("compile: "))
    saved_ms = float(re.search(r"takes ([0-9.]+) ms", line).group(1))
    written = json.loads(plan_path.read_text())
    compiled_path.write_text(json.dumps({**written, "torch_compile": True}))
    code, out_compiled, err = run_cli("simulate", "--plan", str(compiled_path), "--json")
    assert code == 0, err
    expected_ms = (written["prediction"]["step_time_s"] - json.loads(out_compiled)["step_time_s"]) * 1e3
    assert saved_ms == pytest.approx(expected_ms, rel=5e-3)
    peak_saved = written["prediction"]["peak_memory_bytes"] - json.loads(out_compiled)["peak_memory_bytes"]
    said = re.search(r"and ([0-9.]+) GiB off the peak", line)
    assert (said is not None) == (peak_saved >= max(0.01 * written["prediction"]["peak_memory_bytes"], 2**30)), line
    assert (said is not None) == (vocab == 65536), line
    if said:
        assert float(said.group(1)) == pytest.approx(peak_saved / 2**30, abs=0.05)
    code, out, err = run_cli("plan", *job, "--engine", "torchtitan", "--compile")
    assert code == 0 and "compile: " not in out, err


def test_compile_loss_prices_the_loss_and_travels_in_the_plan(run_cli, tmp_path):
    """`--compile` compiles the loss with the model (torchtitan 0.2's `[compile] components`);
    `--compile-loss off` keeps it eager: the head keeps fp32 log-probs and two fp32 copies in backward
    where the compiled loss keeps bf16 logits and two fp32 values per token and works on bf16 logits:
    4 - 2 bytes per logit kept (less the 8 per token) and 8 - 2 worked on more, both times the
    allocator's reserve (`engine_memory.transient_scale`, 5% plain: the head never recomputes).
    The step differs by the bytes a logit the two losses' kernels move. plan.json carries
    `compile_loss` only where set apart, and `simulate` reprices it alike."""
    from meshplan.planner.costing.device_time import memory_time_s
    from meshplan.planner.costing.engine_memory import transient_scale
    from meshplan.planner.costing.hardware import load_cluster

    vocab = 65536  # the logits, not a block, make the peak in both

    def estimate(*flags):
        code, out, err = run_cli("estimate", "--model", SPEC.replace("vocab=4096", f"vocab={vocab}"), *JOB[2:],
                                 "--engine", "torchtitan", "--mbs", "2", *flags, "--json")
        assert code == 0, err
        return json.loads(out)

    compiled, eager = estimate("--compile"), estimate("--compile", "--compile-loss", "off")
    logits = 2 * 2048 * vocab  # micro-batch 2 x seq x vocab on the one rank of dp 8
    assert eager["peak_memory_bytes"] - compiled["peak_memory_bytes"] == pytest.approx(
        ((4 - 2) * logits - 8 * 2 * 2048 + (8 - 2) * logits) * transient_scale("torchtitan", 0.0), rel=1e-9)
    # its time: the bytes a logit its kernels move (`loss_kernels.TORCH_CE_BYTES_PER_LOGIT`, eager without TP
    # 22 and 26, compiled 4 and 4), at h100-sxm's achieved bandwidth, on the one micro-batch
    cluster = load_cluster("h100-sxm")
    assert eager["step_time_s"] - compiled["step_time_s"] == pytest.approx(
        memory_time_s((22 - 4) * logits, cluster) + memory_time_s((26 - 4) * logits, cluster), rel=1e-6)
    code, out, err = run_cli("estimate", *JOB, "--engine", "megatron", "--compile-loss", "on")
    assert code == 2 and "torchtitan" in err and "Traceback" not in err, err
    plan_path = tmp_path / "plan.json"
    code, out, err = run_cli("plan", *JOB, "--engine", "torchtitan", "--compile", "--compile-loss", "off",
                             "--out", str(plan_path))
    assert code == 0, err
    written = json.loads(plan_path.read_text())
    assert written["torch_compile"] is True and written["compile_loss"] is False
    code, out, err = run_cli("simulate", "--plan", str(plan_path), "--json")
    assert code == 0, err
    assert json.loads(out)["peak_memory_bytes"] == pytest.approx(written["prediction"]["peak_memory_bytes"], rel=1e-9)


def test_compile_hint_names_the_memory_its_loss_saves(run_cli):
    """Under torchtitan without --compile, where the eager loss's peak does not fit and the compiled
    one does (a large vocabulary, the usable memory cut between the two by --memory-headroom), the
    does-not-fit line names --compile's peak (`estimate --compile`'s, to the printed 0.1 GiB) and why."""
    model = SPEC.replace("vocab=4096", "vocab=65536")

    def peak_gib(*flags):
        code, out, err = run_cli("estimate", "--model", model, *JOB[2:], "--engine", "torchtitan", "--mbs", "2",
                                 *flags, "--json")
        assert code == 0, err
        return json.loads(out)["peak_memory_bytes"] / 2**30

    eager_gib, compiled_gib = peak_gib(), peak_gib("--compile")
    assert eager_gib - compiled_gib > 1.0
    usable_gib = load_cluster("h100-sxm").device.usable_memory_bytes / 2**30
    headroom = f"{usable_gib - (eager_gib + compiled_gib) / 2:.3f}"
    code, out, err = run_cli("estimate", "--model", model, *JOB[2:], "--engine", "torchtitan", "--mbs", "2",
                             "--memory-headroom", headroom)
    assert code != 0 and "Traceback" not in err, err
    assert (f"--compile (torch.compile, torchtitan's training.compile) gives" in err
            and f"a {compiled_gib:.1f} GiB peak ({eager_gib - compiled_gib:.1f} GiB less, which fits)" in err
            and "its compiled loss keeps the logits in bf16" in err), err
