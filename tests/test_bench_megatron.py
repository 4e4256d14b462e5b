"""scripts/bench_megatron.py's parsing of Megatron-LM's logs (the benchmark itself needs a GPU and
a Megatron-LM checkout) and the Megatron-LM example launcher's shell syntax."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))

import bench_megatron as bm  # noqa: E402


def _megatron_log(times: list[float], max_alloc: float, gemms: str | None) -> str:
    lines = [f" [2026-12-04] iteration {5 * i:8d}/ 20 | elapsed time per iteration (ms): {t:.1f} | lm loss: 9.0 |"
             for i, t in enumerate(times)]
    lines.insert(1, f"[Rank 0] (after 5 iterations) memory (MB) | allocated: 100.00 | max allocated: {max_alloc:.2f}")
    if gemms:
        lines.append(f"megatron_fp8 [rank 0]: {gemms}")
    return "\n".join(lines)


def test_parse_takes_the_steady_intervals_and_peak_memory() -> None:
    out = _megatron_log([2000.0, 700.0, 250.0, 240.0, 260.0], 18150.5, "3840 FP8 GEMMs (native 1280, triton 2560)")
    r = bm.parse("dense-8b", bm.Variant("ours-blockwise", True, "blockwise"), out, 0, 4 * 4096)
    assert r.ms == 250.0  # the median of the intervals ending after iteration 10 (warm-up)
    longer = _megatron_log([2000.0, 700.0, 300.0, 240.0, 230.0, 250.0, 220.0], 1.0, None)  # iterations 1..30
    assert bm.parse("dense-8b", bm.Variant("ours-blockwise", True, "blockwise"), longer, 0, 1).ms == 235.0
    assert r.tokens_per_s == 4 * 4096 / 0.25
    assert r.max_alloc_mib == 18150.5 and r.gemms.startswith("3840 FP8 GEMMs") and r.forwards == ""
    assert r.loss == 9.0 and "last lm loss 9.0000" in bm.table([r])
    logged = out.replace("lm loss: 9.0", "lm loss: 1.034E+01")  # Megatron's own format
    assert bm.parse("dense-8b", bm.Variant("x", True), logged, 0, 1).loss == 10.34
    counted = out + "\nmegatron_fp8 [rank 0]: 1280 FP8 layer forwards (general linear 2, lean linear 1278)"
    r = bm.parse("dense-8b", bm.Variant("ours-blockwise", True, "blockwise"), counted, 0, 4 * 4096)
    assert r.forwards == "general linear 2, lean linear 1278"
    assert "; forwards: general linear 2, lean linear 1278" in bm.table([r])
    failed = bm.parse("moe", bm.Variant("ours-delayed", True, "delayed"), "Traceback ...\nboom", 1, 4096)
    assert failed.ms is None and failed.rc == 1 and "boom" in failed.tail


def test_table_flags_intervals_that_are_not_steady() -> None:
    v = bm.Variant("megatron-bf16", False)
    falling = bm.parse("moe", v, _megatron_log([2000.0, 1000.0, 735.0, 548.0, 517.0, 475.0, 476.0], 1.0, None), 0, 1)
    assert falling.intervals == (548.0, 517.0, 475.0, 476.0) and falling.ms == 496.5
    assert "NOT STEADY, intervals 548 / 517 / 475 / 476 ms (-15% first to last)" in bm.table([falling])
    steady = bm.parse("moe", v, _megatron_log([2000.0, 1000.0, 153.0, 152.0, 144.7, 136.4, 143.2], 1.0, None), 0, 1)
    assert bm.drift(steady.intervals) is None and "NOT STEADY" not in bm.table([steady])  # -7%: within 10%


def test_table_names_a_slow_interval_with_the_means() -> None:
    """Run AR's shape: one interval of ours ~30% over its median (a one-off stall): the median
    leaves it out, so the table names it with the mean over the intervals and the ratio of means
    against the baseline (whose intervals are steady)."""
    base = bm.parse("dense-8b", bm.Variant("megatron-bf16", False),
                    _megatron_log([900.0, 300.0, 280.0, 250.9, 245.0, 243.2, 244.7], 1.0, None), 0, 16384)
    ours = bm.parse("dense-8b", bm.Variant("ours-tensorwise", True, "tensorwise"),
                    _megatron_log([900.0, 300.0, 280.0, 207.9, 202.2, 201.6, 268.8], 1.0, None), 0, 16384)
    assert bm.spikes(base.intervals) == [] and bm.spikes(ours.intervals) == [268.8]
    text = bm.table([base, ours])
    assert "1.194x" in text  # the medians' ratio, as before
    assert "SLOW INTERVAL 269 ms: mean 220.1 ms/iter, 1.117x by means" in text
    assert "SLOW INTERVAL" not in text.splitlines()[1]  # the baseline's row


def test_from_log_rebuilds_results_and_table(tmp_path: os.PathLike[str]) -> None:
    log = os.path.join(tmp_path, "bench_megatron.log")
    with open(log, "w") as f:
        for variant, times in (("megatron-bf16", [900.0, 600.0, 500.0, 500.0]), ("ours-tensorwise",
                                                                              [900.0, 600.0, 400.0, 400.0])):
            f.write(f"===== dense-8b {variant} rc=0\n$ python pretrain_gpt.py --seq-length 4096 "
                    f"--global-batch-size 4\n{_megatron_log(times, 1000.0, None)}\n")
    results = bm.from_logs([log])
    assert [(r.variant, r.ms) for r in results] == [("megatron-bf16", 500.0), ("ours-tensorwise", 400.0)]
    assert "1.250x" in bm.table(results)


def test_repeats_pair_each_round_with_its_own_baseline(tmp_path: os.PathLike[str]) -> None:
    """``--repeats``: the log's sections carry their round, ``from_log`` reads it back, and the
    rounds' table gives the median ms/iter with its range and the median of the ratios taken
    within each round (round 2's host is slow for both variants: its ratio is still 1.25x)."""
    log = os.path.join(tmp_path, "bench_megatron.log")
    rounds = {0: (500.0, 400.0), 1: (650.0, 520.0), 2: (520.0, 430.0)}
    with open(log, "w") as f:
        for k, times in rounds.items():
            for variant, t in zip(("megatron-bf16", "ours-tensorwise"), times):
                f.write(f"===== dense-1b {variant} rc=0 round={k}\n$ python pretrain_gpt.py --seq-length 4096 "
                        f"--global-batch-size 4\n{_megatron_log([900.0, 600.0, t, t], 1000.0, None)}\n")
    results = bm.from_logs([log])
    assert [(r.variant, r.round, r.ms) for r in results][:3] == [("megatron-bf16", 0, 500.0),
                                                                 ("ours-tensorwise", 0, 400.0),
                                                                 ("megatron-bf16", 1, 650.0)]
    text = bm.rounds_table(results)
    ours = next(line for line in text.splitlines() if "ours-tensorwise" in line)
    assert "| 430.0 (400.0-520.0) |" in ours and "| 1.250x (1.209-1.250) |" in ours and "3 of 3" in ours
    base = next(line for line in text.splitlines() if "megatron-bf16" in line)
    assert "| 520.0 (500.0-650.0) |" in base and "1.000x (1.000-1.000)" in base
    paired = bm.paired_ratios(results)  # what the plot draws too: the rounds' ratios, not a ratio of medians
    assert sorted(paired[("dense-1b", "ours-tensorwise")]) == [520.0 / 430.0, 1.25, 1.25]
    # a second call's log with the same rounds: rounds of its own, each rated against its own baseline
    other = os.path.join(tmp_path, "other.log")
    with open(other, "w") as f:
        for variant, t in (("megatron-bf16", 300.0), ("ours-tensorwise", 150.0)):
            f.write(f"===== dense-1b {variant} rc=0 round=0\n$ python pretrain_gpt.py --seq-length 4096 "
                    f"--global-batch-size 4\n{_megatron_log([900.0, 600.0, t, t], 1000.0, None)}\n")
    both = bm.from_logs([log, other])
    assert len(both) == 8 and {r.round for r in both} == {0, 1, 2, 3}
    assert sorted(bm.paired_ratios(both)[("dense-1b", "ours-tensorwise")]) == [520.0 / 430.0, 1.25, 1.25, 2.0]
    assert "4 of 4" in bm.rounds_table(both)
    # a log that only adds variants (a rerun of a call cut short) joins the first log's rounds
    extra = os.path.join(tmp_path, "extra.log")
    with open(extra, "w") as f:
        f.write(f"===== dense-1b ours-blockwise rc=0 round=0\n$ python pretrain_gpt.py --seq-length 4096 "
                f"--global-batch-size 4\n{_megatron_log([900.0, 600.0, 250.0, 250.0], 1000.0, None)}\n")
    joined = bm.from_logs([log, extra])
    assert bm.paired_ratios(joined)[("dense-1b", "ours-blockwise")] == [2.0]


def test_megatron_lm_example_script_parses() -> None:
    script = os.path.join(REPO, "examples", "megatron_lm", "pretrain_gpt_fp8.sh")
    subprocess.run(["bash", "-n", script], check=True)
    proc = subprocess.run(["bash", script], capture_output=True, text=True, env={"PATH": os.environ["PATH"]})
    assert proc.returncode != 0 and "set MEGATRON_LM" in proc.stderr


def test_fp8_variants_pass_megatrons_format_and_recipe(tmp_path: Path) -> None:
    """Every FP8 run passes Megatron's own ``--fp8-format`` / ``--fp8-recipe``: hybrid (E5M2
    gradients, what Megatron users pass), and one blockwise run in E4M3 to set the E5M2 GEMMs apart."""
    import argparse

    args = argparse.Namespace(megatron_lm="/m", layers=2, seq=128, mbs=1, micro=2, iters=4, log_interval=2,
                              out=str(tmp_path))
    formats = {}
    for v in bm.variants(None):
        cmd, _ = bm._command(args, "dense-1b", v, "")
        formats[v.name] = (cmd[cmd.index("--fp8-format") + 1], cmd[cmd.index("--fp8-recipe") + 1]) \
            if "--fp8-format" in cmd else None
    assert formats["ours-blockwise-e4m3"] == ("e4m3", "blockwise")
    assert formats["ours-blockwise"] == ("hybrid", "blockwise")
    assert formats["ours-delayed+flags"] == ("hybrid", "delayed")
    assert formats["megatron-bf16"] is None and formats["ours-bf16"] is None


def test_general_path_variants_turn_the_lean_path_off(monkeypatch) -> None:
    """``ours-<recipe>-general`` runs the same recipe with ``MEGATRON_FP8_LEAN=0`` (what the lean
    eager path buys in Megatron's loop); every other variant runs the default, whatever the caller's
    environment says."""
    import argparse

    monkeypatch.setenv("MEGATRON_FP8_LEAN", "1")
    args = argparse.Namespace(megatron_lm="/m", layers=2, seq=128, mbs=1, micro=2, iters=4, log_interval=2)
    for name in ("ours-tensorwise", "ours-tensorwise-general", "ours-blockwise-general"):
        v = bm.variants([name])[0]
        cmd, env = bm._command(args, "dense-1b", v, "")
        assert env.get("MEGATRON_FP8_LEAN") == ("0" if name.endswith("-general") else None)
        assert cmd[cmd.index("--fp8-recipe") + 1] == name.split("-")[1]


def test_fused_variants_turn_our_wgrad_fusion_on(monkeypatch) -> None:
    """``ours-<recipe>-fused`` adds our linears' wgrads into ``main_grad`` (MEGATRON_FP8_WGRAD_FUSION=on)
    while Megatron's own layers keep ``--no-gradient-accumulation-fusion`` (no apex here); every
    other variant runs without the setting, whatever the caller's environment says."""
    import argparse

    monkeypatch.setenv("MEGATRON_FP8_WGRAD_FUSION", "on")
    args = argparse.Namespace(megatron_lm="/m", layers=2, seq=128, mbs=1, micro=2, iters=4, log_interval=2)
    for name in ("ours-tensorwise", "ours-tensorwise-fused", "ours-blockwise-fused"):
        cmd, env = bm._command(args, "dense-8b", bm.variants([name])[0], "")
        assert env.get("MEGATRON_FP8_WGRAD_FUSION") == ("on" if name.endswith("-fused") else None)
        assert "--no-gradient-accumulation-fusion" in cmd


def test_fused_graphs_variants_and_what_the_graphs_hold(monkeypatch) -> None:
    """``ours-<recipe>-fused-graphs``: the per-layer graphs with our wgrad fusion; the plug-in's
    line on what the graphs hold reaches the table."""
    import argparse

    monkeypatch.delenv("MEGATRON_FP8_GRAPHS", raising=False)
    args = argparse.Namespace(megatron_lm="/m", layers=2, seq=128, mbs=1, micro=2, iters=4, log_interval=2)
    cmd, env = bm._command(args, "dense-1b", bm.variants(["ours-blockwise-fused-graphs"])[0], "")
    assert env.get("MEGATRON_FP8_GRAPHS") == "1" and env.get("MEGATRON_FP8_WGRAD_FUSION") == "on"
    out = _megatron_log([2000.0, 700.0, 150.0, 140.0], 17800.0, "3840 FP8 GEMMs (native 3840)") + (
        "\nmegatron_fp8: MEGATRON_FP8_GRAPHS=1: the CUDA graphs of 16 FP8 linears hold 8,123 MiB between steps "
        "(the most, MiB: x 1)")
    r = bm.parse("dense-1b", bm.variants(["ours-blockwise-fused-graphs"])[0], out, 0, 4 * 4096)
    assert r.graphs_held == "graphs hold 8,123 MiB (16 linears)" and "; graphs hold 8,123 MiB" in bm.table([r])
    assert bm.parse("dense-1b", bm.Variant("ours-blockwise", True, "blockwise"), out.split("\nmegatron_fp8: M")[0],
                    0, 1).graphs_held == ""
    pairs = out.replace("16 FP8 linears hold", "16 FP8 linears (20 graph pairs: one per input signature) hold")
    assert bm.parse("dense-1b", bm.Variant("x", True), pairs, 0, 1).graphs_held == \
        "graphs hold 8,123 MiB (16 linears, 20 graph pairs)"


def test_fusions_megatron_keeps_megatrons_compiled_fusions() -> None:
    """``--fusions megatron`` leaves the SwiGLU and bias-dropout-add fusions on (Megatron's
    default), ``off`` turns them off too; those needing apex or TE are off either way, in both specs."""
    import argparse

    for fusions in ("off", "megatron"):
        args = argparse.Namespace(megatron_lm="/m", layers=2, seq=128, mbs=1, micro=2, iters=4, log_interval=2,
                                  fusions=fusions)
        for name in ("megatron-bf16", "ours-tensorwise"):
            cmd, _ = bm._command(args, "dense-8b", bm.variants([name])[0], "")
            assert all(f in cmd for f in bm.NEEDS_TE_OR_APEX)
            assert all((f in cmd) == (fusions == "off") for f in bm.COMPILED_FUSIONS_OFF)


def test_fusions_rope_runs_every_spec_of_ours_through_the_launcher_with_rope_fusion() -> None:
    """``--fusions rope``: our spec and the baselines that load it keep Megatron's compiled fusions,
    drop ``--no-rope-fusion`` and start through our launcher (the plug-in must fill megatron-core's
    fused-RoPE slot before Megatron-LM checks its config); Megatron's own spec keeps it off."""
    import argparse

    args = argparse.Namespace(megatron_lm="/m", layers=2, seq=128, mbs=1, micro=2, iters=4, log_interval=2,
                              fusions="rope")
    for name, rope in (("megatron-bf16", True), ("ours-tensorwise", True), ("megatron-bf16-own-attn", False)):
        cmd, _ = bm._command(args, "dense-8b", bm.variants([name])[0], "")
        assert (bm.ROPE_FUSION_OFF not in cmd) == rope
        assert ("megatron_fp8.megatron.launch" in cmd) == rope
        assert not any(f in cmd for f in bm.COMPILED_FUSIONS_OFF)
        assert all(f in cmd for f in bm.NEEDS_TE_OR_APEX if f != bm.ROPE_FUSION_OFF)


def test_no_dropout_turns_both_dropouts_off_in_every_variant() -> None:
    import argparse

    for no_dropout in (False, True):
        args = argparse.Namespace(megatron_lm="/m", layers=2, seq=128, mbs=1, micro=2, iters=4, log_interval=2,
                                  no_dropout=no_dropout)
        for name in ("megatron-bf16", "ours-tensorwise", "ours-tensorwise-fullgraph"):
            cmd = bm._command(args, "dense-8b", bm.variants([name])[0], "")[0]
            assert (("--attention-dropout" in cmd) and ("--hidden-dropout" in cmd)) == no_dropout
            assert ("--cuda-graph-impl" in cmd) == name.endswith("fullgraph")


def _trace(tmp: str) -> str:
    """A Chrome trace as torch.profiler writes it: one profiled step of 10 ms (and the stub of the
    next one, where recording stops), kernels on two streams."""
    import gzip
    import json

    def x(cat: str, name: str, ts: float, dur: float) -> dict:
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    events = [x("user_annotation", "ProfilerStep#12", 1000.0, 10000.0),
              x("user_annotation", "ProfilerStep#13", 11000.0, 400.0),  # the stub where recording ends
              x("cpu_op", "_Linear", 1100.0, 900.0), x("cpu_op", "_LinearBackward", 5000.0, 1100.0),
              x("cpu_op", "LeanLinear", 6500.0, 300.0), x("cpu_op", "LeanLinearBackward", 9000.0, 200.0),
              x("cpu_op", "aten::mm", 1200.0, 50.0),
              x("kernel", "_current_persistent_kernel", 1500.0, 500.0),
              x("kernel", "sm90_xmma_gemm_e4m3e4m3_bf16", 2000.0, 3000.0),
              x("kernel", "nvjet_tst_128x256", 4000.0, 2000.0),  # overlaps the GEMM above (another stream)
              x("kernel", "pytorch_flash::flash_fwd_kernel", 7000.0, 600.0),
              x("kernel", "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16", 7600.0, 400.0),
              x("kernel", "elementwise_kernel", 8000.0, 500.0), x("gpu_memset", "Memset", 8500.0, 500.0),
              x("kernel", "sm90_gemm_outside", 20000.0, 5000.0)]  # after the step: not counted
    path = os.path.join(tmp, "rank-0.json.gz")
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return path


def test_trace_summary_splits_a_step(tmp_path: os.PathLike[str]) -> None:
    import trace_step as ts

    s = ts.summarize(ts.load(_trace(str(tmp_path))))
    assert s["steps"] == 1 and s["step"] == 10.0
    assert s["gpu busy"] == 6.5  # 1.5-6.0 (the two GEMMs overlap), 7.0-9.0
    assert s["gpu idle"] == 3.5
    assert (s["gemm"], s["fp8 casts"], s["attention"], s["other"]) == (5.0, 0.5, 1.0, 1.0)
    assert s["host in our layers"] == 2.5  # _Linear's ranges and the lean path's (ops.lean)
    assert "| rank-0 |" in ts.table({"rank-0": s})
    top = ts.top_kernels(ts.load(_trace(str(tmp_path))), k=3)  # the step's kernels by time, not the one after it
    assert top == [("sm90_xmma_gemm_e4m3e4m3_bf16", "gemm", 1, 3.0), ("nvjet_tst_128x256", "gemm", 1, 2.0),
                   ("pytorch_flash::flash_fwd_kernel", "attention", 1, 0.6)]
    assert ts.kind("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16") == "attention"  # not a GEMM
    assert "| sm90_xmma_gemm_e4m3e4m3_bf16 | gemm | 1 | 3 |" in ts.kernels_table(top)


def test_trace_window_counts_full_steps_only() -> None:
    import trace_step as ts

    def step(i: int, ts0: float, dur: float) -> dict:
        return {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{i}", "ts": ts0, "dur": dur}

    assert ts._window([step(1, 0.0, 100.0), step(2, 100.0, 98.0)]) == (2, 0.0, 198.0)
    assert ts._window([step(1, 0.0, 100.0), step(2, 100.0, 3.0)]) == (1, 0.0, 100.0)  # a stub: not a step
    assert ts._window([step(1, 0.0, 100.0), step(2, 0.0, 100.0)]) == (1, 0.0, 100.0)  # one step annotated twice


def test_profile_runs_megatrons_profiler_on_one_iteration(tmp_path: os.PathLike[str]) -> None:
    import argparse
    import shutil

    args = argparse.Namespace(megatron_lm="/m", layers=2, seq=128, mbs=1, micro=2, iters=30, log_interval=5,
                              profile=True, out=str(tmp_path))
    v = bm.variants(["ours-tensorwise"])[0]
    cmd, _ = bm._command(args, "dense-1b", v, "")
    assert cmd[cmd.index("--profile-step-start") + 1] == "12" and cmd[cmd.index("--profile-step-end") + 1] == "13"
    assert "--use-pytorch-profiler" in cmd
    tb = cmd[cmd.index("--tensorboard-dir") + 1]
    assert bm.profile_of(args, "dense-1b", v) is None  # no trace written yet
    where = os.path.join(os.path.dirname(tb), "torch_profile")  # Megatron writes it beside the TensorBoard dir
    os.makedirs(where)
    shutil.copy(_trace(str(tmp_path)), os.path.join(where, "rank-0.json.gz"))
    prof = bm.profile_of(args, "dense-1b", v)
    assert prof["gemm"] == 5.0 and prof["kernels"][0][0] == "sm90_xmma_gemm_e4m3e4m3_bf16"
    assert prof["annotations"] == [("ProfilerStep#12", 10.0), ("ProfilerStep#13", 0.4)]


def test_caller_variants_run_backward_on_the_main_thread(tmp_path: Path) -> None:
    """The ``-caller`` variants (and only they) put a ``sitecustomize`` first on PYTHONPATH that
    turns the autograd engine's multithreading off on the main thread; the baseline's caller
    variant keeps the baseline's spec."""
    import argparse

    args = argparse.Namespace(megatron_lm="/m", layers=2, seq=128, mbs=1, micro=2, iters=4, log_interval=2,
                              out=str(tmp_path))
    envs = {v.name: bm._command(args, "dense-1b", v, "") for v in bm.variants(None)}
    assert envs["megatron-bf16-caller"][0][envs["megatron-bf16-caller"][0].index("--spec") + 2] == "baseline_spec"
    for name, (_, env) in envs.items():
        first = env["PYTHONPATH"].split(os.pathsep)[0]
        assert os.path.isfile(os.path.join(first, "sitecustomize.py")) == name.endswith("-caller"), name
    env = dict(os.environ, PYTHONPATH=envs["ours-tensorwise-caller"][1]["PYTHONPATH"])
    probe = ("import threading, torch; r = []; t = threading.Thread(target=lambda: "
             "r.append(torch._C._is_multithreading_enabled())); t.start(); t.join(); "
             "print(torch._C._is_multithreading_enabled(), r[0])")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"]  # off on the main thread only


def test_caller_variants_are_rated_against_the_caller_baseline() -> None:
    """A ``-caller`` variant's ratio is to Megatron's BF16 with its backward on the caller too;
    the others' to the default baseline."""
    def result(variant: str, tps: float) -> bm.Result:
        return bm.Result("dense-1b", variant, 1e3 / tps, tps, 1.0, "", 0, "")

    rows = bm.table([result("megatron-bf16", 100.0), result("megatron-bf16-caller", 200.0),
                     result("ours-tensorwise", 150.0), result("ours-tensorwise-caller", 300.0)]).splitlines()
    ratio = {row.split()[1]: row.split()[4] for row in rows[1:]}
    assert ratio == {"megatron-bf16": "1.000x", "megatron-bf16-caller": "1.000x", "ours-tensorwise": "1.500x",
                     "ours-tensorwise-caller": "1.500x"}


def test_fullgraph_variants_run_megatrons_whole_iteration_graph(tmp_path: Path) -> None:
    """The ``-fullgraph`` variants (and only they) pass Megatron-LM's whole-iteration CUDA graph
    options; each is rated against Megatron's BF16 under the same graph, and against the eager
    baseline in its notes."""
    import argparse

    args = argparse.Namespace(megatron_lm="/m", layers=2, seq=128, mbs=1, micro=2, iters=4, log_interval=2,
                              out=str(tmp_path))
    cmds = {v.name: bm._command(args, "dense-1b", v, "")[0] for v in bm.variants(None)}
    for name, cmd in cmds.items():
        graphed = "--cuda-graph-impl" in cmd
        assert graphed == name.endswith("-fullgraph"), name
        if graphed:
            assert cmd[cmd.index("--cuda-graph-impl") + 1] == "full_iteration"
            assert "--no-check-for-nan-in-loss-and-grad" in cmd
    assert cmds["megatron-bf16-fullgraph"][cmds["megatron-bf16-fullgraph"].index("--spec") + 2] == "baseline_spec"
    assert {"ours-tensorwise-fullgraph", "ours-blockwise-fullgraph", "ours-bf16-fullgraph"} <= set(cmds)
    fused = bm.variants(["ours-tensorwise-fused-fullgraph"])[0]  # our wgrad fusion under the graph too
    cmd, env = bm._command(args, "dense-1b", fused, "")
    assert "--cuda-graph-impl" in cmd and env.get("MEGATRON_FP8_WGRAD_FUSION") == "on"
    assert bm._baseline(fused.name) == "megatron-bf16-fullgraph"
    assert "--no-check-for-nan-in-loss-and-grad" not in cmds["ours-tensorwise"]
    args.no_nan_check = True  # eager runs on the graph's terms
    eager = bm._command(args, "dense-1b", bm.Variant("ours-tensorwise", True, "tensorwise"), "")[0]
    graphed = bm._command(args, "dense-1b", bm.Variant("megatron-bf16-fullgraph", False, full_graph=True), "")[0]
    off = "--no-check-for-nan-in-loss-and-grad"
    assert eager.count(off) == graphed.count(off) == 1
    moe = bm._command(args, "moe-capacity", bm.Variant("ours-tensorwise-fullgraph", True, "tensorwise",
                                                       full_graph=True), "")[0]
    assert "--num-experts" in moe and "--moe-pad-expert-input-to-capacity" in moe
    assert moe[moe.index("--moe-expert-capacity-factor") + 1] == "1.0"  # MoE with static shapes, graphable
    assert "--moe-pad-expert-input-to-capacity" not in bm._command(args, "moe", bm.Variant("ours-bf16", True), "")[0]

    def result(variant: str, tps: float) -> bm.Result:
        return bm.Result("dense-1b", variant, 1e3 / tps, tps, 1.0, "", 0, "")

    rows = bm.table([result("megatron-bf16", 100.0), result("megatron-bf16-fullgraph", 125.0),
                     result("ours-tensorwise-fullgraph", 150.0)]).splitlines()
    by_name = {row.split()[1]: row for row in rows[1:]}
    assert by_name["ours-tensorwise-fullgraph"].split()[4] == "1.200x"
    assert by_name["ours-tensorwise-fullgraph"].endswith("1.500x megatron-bf16")
    assert by_name["megatron-bf16-fullgraph"].split()[4] == "1.000x"


def test_run_sampled_attaches_py_spy_after_the_warm_up(tmp_path: Path) -> None:
    """``--pyspy``: the run's output and return code as without it, and py-spy started on the
    process only once Megatron has logged iteration 10 (a stand-in py-spy records its arguments)."""
    spy = tmp_path / "py-spy"
    seen = tmp_path / "spy_args"
    spy.write_text(f"#!/bin/sh\necho \"$@\" > {seen}\n")
    spy.chmod(0o755)
    run = tmp_path / "run.py"
    run.write_text("import sys, time\n"
                   "for i in (1, 5, 10, 15):\n"
                   "    print(f' iteration {i:8d}/ 15 | elapsed time per iteration (ms): 9.0 |', flush=True)\n"
                   "    if i == 5:\n"
                   f"        assert not __import__('os').path.exists({str(seen)!r})  # not before the warm-up\n"
                   "    time.sleep(0.3)\n"
                   "sys.exit(3)\n")
    args = bm.argparse.Namespace(timeout=30, pyspy=50.0, pyspy_bin=str(spy))
    out, rc = bm.run_sampled([sys.executable, str(run)], dict(os.environ), args, str(tmp_path / "samples.txt"))
    assert rc == 3 and out.count("elapsed time per iteration") == 4 and "AssertionError" not in out
    argv = seen.read_text().split()
    assert argv[:2] == ["record", "--pid"] and "--subprocesses" in argv and "--idle" in argv
    assert argv[argv.index("--rate") + 1] == "50" and argv[-1] == str(tmp_path / "samples.txt")
    slow = tmp_path / "slow.py"
    slow.write_text("import time\ntime.sleep(30)\n")
    out, rc = bm.run_sampled([sys.executable, str(slow)], dict(os.environ), bm.argparse.Namespace(
        timeout=1, pyspy=50.0, pyspy_bin=str(spy)), str(tmp_path / "s2.txt"))
    assert rc == -1 and out.endswith("TIMEOUT") and "never started" in out


def test_pyspy_summary_splits_wall_time_by_phase() -> None:
    import trace_step

    worker = 'process 11:"python -m torch.distributed.run pretrain_gpt.py";process 12:"python -u pretrain_gpt.py ' \
             '--fp8-format hybrid"'  # py-spy names a child's parents first
    loop = "main (megatron_fp8/megatron/launch.py:9);" \
           "pretrain (megatron/training/training.py:1);train (megatron/training/training.py:2);" \
           "train_step (megatron/training/training.py:3)"  # our launcher at the root: not one of our layers
    raw = "\n".join([
        'process 11:"python -m torch.distributed.run pretrain_gpt.py";thread (11): MainThread;run (torch/x.py:1) 500',
        f"{worker};thread (12): MainThread;{loop};forward_backward_no_pipelining (s.py:4);"
        "forward_step (s.py:5);forward (megatron_fp8/modules/linear.py:9) 30",
        f"{worker};thread (12): MainThread;{loop};forward_backward_no_pipelining (s.py:4);forward_step (s.py:5);"
        "forward (megatron/core/transformer/attention.py:7) 10",
        f"{worker};thread (12): MainThread;{loop};forward_backward_no_pipelining (s.py:4);backward_step (s.py:6);"
        "backward (torch/autograd/__init__.py:8) 40",
        f"{worker};thread (12): MainThread;{loop};step (megatron/core/optimizer/optimizer.py:9) 15",
        f"{worker};thread (12): MainThread;{loop};training_log (megatron/training/training.py:10) 5",
        f"{worker};thread (12): MainThread;main (pretrain_gpt.py:1) 0",
        f"{worker};thread (13);backward (megatron_fp8/ops/lean.py:3) 25",
        # a forked data-loader worker: the same command, another process
        f'{worker};process 14:"python -u pretrain_gpt.py --fp8-format hybrid";thread (14): MainThread;'
        "collate (torch/utils/data/_utils/collate.py:1) 300",
    ])
    procs = trace_step.pyspy_parse(raw)
    assert trace_step.pyspy_process(procs) == "12 python -u pretrain_gpt.py --fp8-format hybrid"
    main = procs["12 python -u pretrain_gpt.py --fp8-format hybrid"]["MainThread"]
    assert main.total == 100 and main.phases["forward"] == 40 and main.ours["forward"] == 30
    assert main.phases["backward"] == 40 and main.phases["optimizer"] == 15 and main.phases["train_step, other"] == 5
    assert main.tops["backward (torch/autograd/__init__.py:8)"] == 40
    text = trace_step.pyspy_table(procs["12 python -u pretrain_gpt.py --fp8-format hybrid"], rate=100)
    assert "| forward | 40.0% | 30.0% |" in text and "MainThread: 100 samples, 1.0 s sampled" in text
    assert "thread 13: 25 samples" in text and "| outside train_step | 100.0% | 100.0% |" in text


def test_megatron_args_reach_every_variant() -> None:
    """``--megatron-args``: one string of Megatron-LM arguments, split as a shell would, appended
    to every variant's command (baseline and ours alike)."""
    import argparse

    args = argparse.Namespace(megatron_lm="/m", layers=2, seq=128, mbs=1, micro=2, iters=4, log_interval=2,
                              megatron_args="--recompute-granularity full --recompute-method 'uniform'")
    for name in ("megatron-bf16", "ours-tensorwise", "ours-blockwise-fullgraph"):
        cmd = bm._command(args, "dense-1b", bm.variants([name])[0], "")[0]
        i = cmd.index("--recompute-granularity")
        assert cmd[i:i + 4] == ["--recompute-granularity", "full", "--recompute-method", "uniform"]
