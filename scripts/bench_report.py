#!/usr/bin/env python3
"""Reads the benchmark JSON in build/release/bench/ and prints the results table; writes
report.md and, with gnuplot, causal_time.png and decode_latency.png beside the JSON.

    scripts/bench_report.py [bench_dir]
"""
import json
import os
import re
import shutil
import subprocess
import sys

UNIT_TO_S = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
NAME = re.compile(r"^(BM_\w+)<(\w+)>(?:/(\d+))?(?:/min_time:[\d.]+)?$")


def read_json(path):
    """The benchmark JSON at path, or None if it is missing or empty (a binary whose
    --benchmark_filter matched nothing leaves an empty file)."""
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return None
    with open(path) as f:
        return json.load(f)


def load(path):
    """{(family, scalar, arg): entry} for one benchmark JSON file, or {} if it is missing."""
    data = read_json(path)
    if data is None:
        return {}
    out = {}
    for b in data.get("benchmarks", []):
        if b.get("run_type", "iteration") != "iteration":
            continue
        m = NAME.match(b["name"])
        if not m:
            continue
        b["seconds"] = b["real_time"] * UNIT_TO_S[b.get("time_unit", "ns")]
        out[(m.group(1), m.group(2), int(m.group(3) or 0))] = b
    return out


def fmt_time(seconds):
    if seconds is None:
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def fmt_bytes(n):
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def causal_section(causal, scalar, plot_rows):
    gemm = causal.get(("BM_EigenGemm", scalar, 512))
    peak = gemm["FLOPS"] if gemm else None
    sizes = sorted({k[2] for k in causal if k[1] == scalar and k[0] == "BM_CausalLinear_Elu"})
    if not sizes:
        return ""
    forms = [("BM_CausalLinear_Elu", "linear elu+1"), ("BM_CausalLinear_Favor", "linear FAVOR+ m=256"),
             ("BM_SoftmaxTiled", "softmax tiled"), ("BM_SlidingWindow", "sliding window 256"),
             ("BM_SoftmaxMaterialized", "softmax materialised")]
    rows = []
    crossover = None
    for n in sizes:
        get = lambda fam: causal.get((fam, scalar, n))
        times = [get(fam)["seconds"] if get(fam) else None for fam, _ in forms]
        lin, soft = times[0], times[2]
        speedup = f"{soft / lin:.1f}x" if lin and soft else "-"
        if lin and soft and lin < soft and crossover is None:
            crossover = n
        if lin and soft and lin >= soft:
            crossover = None  # must stay ahead from here on
        shares = []
        for fam in ("BM_CausalLinear_Elu", "BM_CausalLinear_Favor", "BM_CausalKernel64",
                    "BM_CausalKernel256", "BM_SoftmaxTiled"):
            e = get(fam)
            shares.append(f"{100 * e['FLOPS'] / peak:.0f}%" if e and peak else "-")
        rows.append([n] + [fmt_time(t) for t in times] + [speedup] + shares)
        plot_rows.append((scalar, n, times))
    header = (["N"] + [label for _, label in forms] + ["linear / tiled speed-up"] +
              ["elu+1 % GEMM", "FAVOR+ % GEMM", "kernel C=64 % GEMM", "kernel C=256 % GEMM",
               "tiled % GEMM"])
    text = f"### Causal forward, {scalar}, d = 64, one thread\n\n"
    if gemm:
        text += f"Eigen {scalar} GEMM 512^3: {gemm['FLOPS'] / 1e9:.1f} GFLOP/s (the 100% below).\n\n"
    text += table(header, rows) + "\n\n"
    text += f"Crossover (linear elu+1 faster than tiled softmax from here on): N = {crossover}\n\n"
    text += ("FLOP rates count useful FLOPs: 4 N C Dv for linear attention (the recurrent minimum), "
             "2 N (N+1) d for causal softmax. The elu+1 and FAVOR+ columns include computing the "
             "features from raw q, k; the kernel columns take featurized inputs (Dv = 64).\n\n")
    return text


def half_section(causal):
    """16-bit inputs (float accumulation) against float inputs at the same N."""
    sizes = sorted({k[2] for k in causal
                    if k[1] in ("half", "bfloat16") and k[0] == "BM_CausalLinear_Elu"})
    if not sizes:
        return ""
    rows = []
    for n in sizes:
        row = [n]
        for fam in ("BM_CausalLinear_Elu", "BM_CausalKernel64"):
            entries = [causal.get((fam, scalar, n)) for scalar in ("float", "half", "bfloat16")]
            row += [fmt_time(e["seconds"]) if e else "-" for e in entries]
            base = entries[0]
            row.append(" / ".join(f"{e['seconds'] / base['seconds']:.2f}" if e and base else "-"
                                  for e in entries[1:]))
        rows.append(row)
    header = ["N", "elu+1 float", "elu+1 half", "elu+1 bfloat16", "time vs float (half / bf16)",
              "kernel C=64 float", "kernel half", "kernel bfloat16", "time vs float (half / bf16)"]
    return ("### Causal forward, 16-bit inputs (float accumulation), d = C = Dv = 64, one thread\n\n" +
            table(header, rows) + "\n\n" +
            "Inputs and outputs in Eigen::half / Eigen::bfloat16, converted chunk by chunk; the "
            "sums in float. Ratios are times against the float row of the same N.\n\n")


def decode_section(decode, scalar, plot_rows):
    contexts = sorted({k[2] for k in decode if k[1] == scalar and k[0] == "BM_RecurrentStep"})
    if not contexts:
        return ""
    rows = []
    for t in contexts:
        rnn = decode.get(("BM_RecurrentStep", scalar, t))
        kv = decode.get(("BM_KVCacheStep", scalar, t))
        win = decode.get(("BM_SlidingWindowStep", scalar, t))
        secs = [e["seconds"] if e else None for e in (rnn, kv, win)]
        speedup = f"{secs[1] / secs[0]:.3g}x" if secs[0] and secs[1] else "-"
        rows.append([t] + [fmt_time(s) for s in secs] + [speedup] +
                    [fmt_bytes(e["bytes"]) if e else "-" for e in (rnn, kv, win)])
        plot_rows.append((scalar, t, secs))
    header = ["context t", "recurrent step", "KV-cache step", "window-256 step",
              "KV / recurrent", "state bytes", "KV-cache bytes", "window bytes"]
    first = decode.get(("BM_RecurrentStep", scalar, contexts[0]))
    last = decode.get(("BM_RecurrentStep", scalar, contexts[-1]))
    flat = ""
    if first and last:
        flat = (f"Recurrent step at t = {contexts[-1]} vs t = {contexts[0]}: "
                f"{100 * (last['seconds'] / first['seconds'] - 1):+.1f}%\n\n")
    return (f"### Decoding, {scalar}, C = Dk = Dv = 64, one thread\n\n" + table(header, rows) +
            "\n\n" + flat)


def backward_section(backward, scalar):
    """Forward + backward (bench_backward): linear elu+1 against the tiled softmax baseline,
    with each method's (forward + backward) / forward ratio."""
    gemm = backward.get(("BM_EigenGemm", scalar, 512))
    peak = gemm["FLOPS"] if gemm else None
    fams = ("BM_LinearForwardBackward", "BM_SoftmaxForwardBackward", "BM_LinearForward",
            "BM_SoftmaxForward")
    sizes = sorted({k[2] for k in backward if k[1] == scalar and k[0] in fams})
    if not sizes:
        return ""
    rows = []
    for n in sizes:
        lin, soft, lin_fwd, soft_fwd = (backward.get((fam, scalar, n)) for fam in fams)
        secs = lambda e: e["seconds"] if e else None
        ratio = lambda a, b: f"{a['seconds'] / b['seconds']:.1f}x" if a and b else "-"
        share = lambda e: f"{100 * e['FLOPS'] / peak:.0f}%" if e and peak else "-"
        rows.append([n, fmt_time(secs(lin)), fmt_time(secs(soft)), ratio(soft, lin),
                     ratio(lin, lin_fwd), ratio(soft, soft_fwd), share(lin), share(soft)])
    header = ["N", "linear fwd+bwd", "softmax fwd+bwd", "linear / softmax speed-up",
              "linear (fwd+bwd) / fwd", "softmax (fwd+bwd) / fwd", "linear % GEMM",
              "softmax % GEMM"]
    text = f"### Causal forward + backward, {scalar}, d = C = Dv = 64, one thread\n\n"
    if gemm:
        text += f"Eigen {scalar} GEMM 512^3: {gemm['FLOPS'] / 1e9:.1f} GFLOP/s (the 100% below).\n\n"
    text += table(header, rows) + "\n\n"
    text += ("Linear: elu+1 features computed inside the timed region, the backward through the "
             "feature map. Softmax: the tiled forward, then the FlashAttention-2-style tiled "
             "backward, which recomputes the softmax statistics. Useful FLOPs for fwd+bwd: "
             "12 N C Dv for linear, 3.5 x 2 N (N+1) d for causal softmax (the recomputation "
             "not counted).\n\n")
    return text


def feature_section(features):
    rows = []
    for (fam, scalar, _), e in sorted(features.items()):
        rows.append([fam.replace("BM_FeatureMap_", ""), scalar, int(e.get("C", 0)),
                     fmt_time(e["seconds"]), f"{e['tokens_per_s'] / 1e6:.2f} M"])
    if not rows:
        return ""
    return ("### Feature maps, 4096 x 64 inputs, 64 rows per call (as the kernels call them)\n\n" +
            table(["map", "scalar", "C", "time", "rows/s"], rows) + "\n\n")


def plot(bench_dir, causal_rows, decode_rows):
    if not shutil.which("gnuplot"):
        print("(gnuplot not found: no plots)")
        return
    labels = ["linear elu+1", "linear FAVOR+", "softmax tiled", "sliding window", "softmax materialised"]
    for scalar in ("float", "double"):
        path = os.path.join(bench_dir, f"causal_{scalar}.dat")
        with open(path, "w") as f:
            for s, n, times in causal_rows:
                if s == scalar:
                    f.write(f"{n} " + " ".join(f"{t:.6g}" if t else "NaN" for t in times) + "\n")
    with open(os.path.join(bench_dir, "decode_float.dat"), "w") as f:
        for s, t, secs in decode_rows:
            if s == "float":
                f.write(f"{max(t, 1)} " + " ".join(f"{x * 1e6:.6g}" if x else "NaN" for x in secs) + "\n")
    causal_plot = ", ".join(
        f"'causal_float.dat' using 1:{i + 2} with linespoints title '{label}'"
        for i, label in enumerate(labels))
    script = f"""
set terminal pngcairo size 900,600 noenhanced
set logscale xy
set format x '%g'
set format y '%g'
set grid
set key top left
set output 'causal_time.png'
set title 'Causal forward, float, d = 64, one thread'
set xlabel 'sequence length N'
set ylabel 'seconds'
plot {causal_plot}
set output 'decode_latency.png'
set title 'Decoding step latency, float, C = Dk = Dv = 64'
set xlabel 'context t (tokens)'
set ylabel 'microseconds per step'
plot 'decode_float.dat' using 1:2 with linespoints title 'recurrent state', \\
     'decode_float.dat' using 1:3 with linespoints title 'softmax KV cache', \\
     'decode_float.dat' using 1:4 with linespoints title 'sliding window 256'
"""
    result = subprocess.run(["gnuplot"], input=script, text=True, cwd=bench_dir,
                            capture_output=True)
    if result.returncode != 0:
        print("gnuplot failed:", result.stderr.strip())
        return
    print(f"plots: {os.path.join(bench_dir, 'causal_time.png')}, "
          f"{os.path.join(bench_dir, 'decode_latency.png')}")


THREADS_NAME = re.compile(r"^(BM_\w+)<(\w+)>/(\d+)/(\d+)/real_time$")


def threads_section(path):
    """Thread scaling from bench_threads: each row's rate against the same kernel on one
    thread and against Eigen's single-thread GEMM from the same run."""
    data = read_json(path)
    if data is None:
        return ""
    runs, gemm = {}, {}
    for b in data.get("benchmarks", []):
        if b.get("run_type", "iteration") != "iteration":
            continue
        m = NAME.match(b["name"])
        if m and m.group(1) == "BM_EigenGemm":
            gemm[m.group(2)] = b["FLOPS"]
            continue
        m = THREADS_NAME.match(b["name"])
        if m:
            runs[(m.group(1), m.group(2), int(m.group(3)), int(m.group(4)))] = b
    if not runs:
        return ""
    rows = []
    for (family, scalar, n, threads), b in sorted(runs.items()):
        one = runs.get((family, scalar, n, 1))
        speedup = f"{b['FLOPS'] / one['FLOPS']:.2f}x" if one else "-"
        peak = gemm.get(scalar)
        share = f"{100 * b['FLOPS'] / threads / peak:.0f}%" if peak else "-"
        rows.append([family, scalar, n, threads,
                     fmt_time(b["real_time"] * UNIT_TO_S[b.get("time_unit", "ns")]),
                     f"{b['FLOPS'] / 1e9:.1f}", speedup, share])
    return ("### Threads (bench_threads, OpenMP; C = Dv = 64, 16 heads = [4, 4, N, 64])\n\n" +
            table(["benchmark", "scalar", "N", "threads", "time", "GFLOP/s", "vs 1 thread",
                   "per thread, % of 1-thread GEMM"], rows) + "\n\n")


def compile_section(path):
    """The compile-cost table of scripts/compile_cost --out, when it ran."""
    if not os.path.exists(path):
        return ""
    with open(path) as f:
        data = json.load(f)
    rows = [[r["tu"], r["mode"], f"{r['seconds']:.2f}", f"{r['peak_mb']:.0f}",
             f"{r['ratio_to_gemm']:.2f}"] for r in data["rows"]]
    text = (f"### Compile cost ({data['cxx']} {data['flags']}, median of {data['repeat']}, "
            "interleaved)\n\n")
    text += table(["TU", "mode", "seconds", "peak MB", "x Eigen GEMM TU"], rows)
    text += ("\nTarget: `causal_elu` at most 2x `eigen_gemm`. `compiled` is the same TU with "
             "-DLINATTN_COMPILED (the kernels come from linattn::compiled).\n\n")
    return text


def gated_section(gated):
    """Gated kernels (bench_gated): scalar and per-feature gates beside the ungated kernel and
    the per-token step loop, each shape's rates as a share of the ungated one in the same run."""
    gemm = gated.get(("BM_EigenGemm", "float", 512))
    pattern = re.compile(r"^BM_Gated_(\w+?)_(\w+)$")
    shapes = {}
    for (fam, scalar, n), e in gated.items():
        m = pattern.match(fam)
        if m:
            shapes.setdefault((m.group(2), scalar, n), {})[m.group(1)] = e
    if not shapes:
        return ""
    rows = []
    for (shape, scalar, n), kinds in sorted(shapes.items()):
        base = kinds.get("Ungated")
        def cell(kind):
            e = kinds.get(kind)
            if not e:
                return "-"
            share = f" ({100 * e['FLOPS'] / base['FLOPS']:.0f}%)" if base else ""
            return f"{e['FLOPS'] / 1e9:.1f}{share}"
        loop, feature = kinds.get("StepLoop"), kinds.get("FeatureGates")
        speedup = f"{loop['seconds'] / feature['seconds']:.1f}x" if loop and feature else "-"
        rows.append([shape, scalar, n, cell("Ungated"), cell("ScalarGates"),
                     cell("FeatureGates"), cell("StepLoop"), speedup])
    header = ["shape", "scalar", "N", "ungated GFLOP/s", "scalar gates (% ungated)",
              "per-feature gates (% ungated)", "step loop (% ungated)",
              "per-feature / step loop speed-up"]
    text = "### Gated causal attention, one head, one thread\n\n"
    if gemm:
        text += f"Eigen float GEMM 512^3: {gemm['FLOPS'] / 1e9:.1f} GFLOP/s.\n\n"
    text += table(header, rows) + "\n\n"
    text += ("Featurized inputs (Identity), log gates in [-0.05, 0]; C64: C = Dv = 64, GLA128: "
             "C = Dv = 128, Mamba2: state 128 (C) by head dim 64 (Dv). Useful FLOPs 4 N C Dv for "
             "every row; the step loop is RecurrentState::step_into over every token with "
             "per-feature gates, the per-token form ggml's gated op runs.\n\n")
    return text


def gated_heads_section(gated):
    """Transitions on multi-head views (bench_gated's BM_GatedHeads8 rows): each transition's rate
    as a share of the ungated kernel's, token-major ([B, N, H, D]) against head-contiguous
    ([B, H, N, D]) views, and the share of a call check_finite's scan takes."""
    pattern = re.compile(r"^BM_GatedHeads8_(\w+?)_(BHND|BNHD)(_NoScan)?$")
    cells = {}
    for (fam, scalar, n), e in gated.items():
        m = pattern.match(fam)
        if m:
            cells[(m.group(1), m.group(2), bool(m.group(3)), n)] = e
    if not cells:
        return ""
    rows = []
    sizes = sorted({key[3] for key in cells})
    for n in sizes:
        base = cells.get(("Ungated", "BHND", False, n))
        for kind in ("Ungated", "HeadDecays", "ScalarGates", "FeatureGates"):
            bhnd, bnhd = cells.get((kind, "BHND", False, n)), cells.get((kind, "BNHD", False, n))
            bhnd_ns = cells.get((kind, "BHND", True, n))
            bnhd_ns = cells.get((kind, "BNHD", True, n))
            if not bhnd or not bnhd:
                continue
            share = f"{100 * bhnd['FLOPS'] / base['FLOPS']:.0f}%" if base else "-"
            def scan(with_scan, without):
                if not without:
                    return "-"
                return f"{100 * (1 - without['seconds'] / with_scan['seconds']):.0f}%"
            rows.append([n, kind, f"{bhnd['FLOPS'] / 1e9:.1f}", share,
                         f"{bnhd['seconds'] / bhnd['seconds']:.2f}", scan(bhnd, bhnd_ns),
                         scan(bnhd, bnhd_ns)])
    header = ["N", "transition", "[B,H,N,D] GFLOP/s", "% ungated", "[B,N,H,D] / [B,H,N,D] time",
              "scan share [B,H,N,D]", "scan share [B,N,H,D]"]
    text = "### Transitions on multi-head views: 8 heads, C = Dv = 64, float, one thread\n\n"
    text += table(header, rows) + "\n\n"
    text += ("HeadDecays: RetNet's 1 - 2^(-5-h); gates: log gates in [-0.05, 0] as views laid out "
             "like q, k and v. The scan share is 1 - (time without check_finite) / (time with "
             "it); the gates' range check runs in both. Targets: token-major within 1.15x, scan "
             "at most 10%.\n\n")
    return text


def backward_ratio_section(backward):
    """The backward's cost against the forward (bench_backward, float): the linear kernel
    through the map (allocating, and with a workspace) and GLA's gated form, each as
    (forward + backward) / forward, with the targets."""
    scalar = "float"
    fams = ("BM_LinearForward", "BM_LinearForwardBackward", "BM_LinearForwardBackwardWorkspace",
            "BM_GatedForward", "BM_GatedForwardBackward")
    sizes = sorted({k[2] for k in backward if k[1] == scalar and k[0] in fams})
    if not sizes:
        return ""
    rows = []
    for n in sizes:
        fwd, both, work, gated_fwd, gated = (backward.get((fam, scalar, n)) for fam in fams)
        ms = lambda e: f"{e['seconds'] * 1e3:.3g}" if e else "-"
        ratio = lambda a, b: f"{a['seconds'] / b['seconds']:.2f}" if a and b else "-"
        rows.append([n, ms(fwd), ms(both), ratio(both, fwd), ms(work), ratio(work, fwd),
                     ms(gated_fwd), ms(gated), ratio(gated, gated_fwd)])
    header = ["N", "linear fwd ms", "fwd+bwd ms", "ratio", "workspace fwd+bwd ms", "ratio",
              "gated fwd ms", "fwd+bwd ms", "ratio"]
    return ("### Backward against the forward (bench_backward, float, C = Dv = 64, one thread)\n\n" +
            table(header, rows) + "\n\n" +
            "Linear: elu+1 features computed inside the timed region, the backward through the "
            "map (the allocating call; workspace: a BackwardWorkspace kept across iterations). "
            "Gated: GLA's form, featurized q and k, per-feature log gates (about -0.05), "
            "normalize off, with a workspace (it also gives d loss / d g). Ratio = (forward + "
            "backward) / forward; the backward alone is the ratio minus 1. Targets: backward "
            "alone at most 3.5x the forward, forward + backward at most 4.5x.\n\n")


DELTA_NAME = re.compile(r"^BM_Delta(Chunked|Streamed|Step|EigenLoop)_(?:(\w+?)_)?D(\d+)(?:_L(\d+))?$")


def delta_section(delta):
    """The delta rule (bench_delta, float, one head, one thread): every form's rate, as a share
    of Eigen's sgemm in the same run and as a speed-up over the per-token Eigen loop."""
    gemm = delta.get(("BM_EigenGemm", "float", 512))
    peak = gemm["FLOPS"] if gemm else None
    cells = {}
    for (fam, scalar, n), e in delta.items():
        m = DELTA_NAME.match(fam)
        if m and scalar == "float":
            form, variant, dim, chunk = m.groups()
            cells[(int(dim), n, form, variant or "", int(chunk or 0))] = e
    if not cells:
        return ""
    rows = []
    for dim in sorted({k[0] for k in cells}, reverse=True):
        for n in sorted({k[1] for k in cells if k[0] == dim}):
            loop = cells.get((dim, n, "EigenLoop", "", 0))
            # The chunked form at its fastest chunk length only (bench_delta runs 16, 32, 64).
            best = {}
            for k in cells:
                if k[0] == dim and k[1] == n and k[2] == "Chunked":
                    if k[3] not in best or cells[k]["seconds"] < cells[best[k[3]]]["seconds"]:
                        best[k[3]] = k
            keys = sorted((k for k in cells if k[0] == dim and k[1] == n and
                           (k[2] != "Chunked" or best.get(k[3]) == k)),
                          key=lambda k: (["Streamed", "Chunked", "Step", "EigenLoop"].index(k[2]),
                                         k[3], k[4]))
            for key in keys:
                _, _, form, variant, chunk = key
                e = cells[key]
                path = {"Streamed": f"{variant}, streamed",
                        "Chunked": f"{variant}, chunked (fastest L: {chunk})",
                        "Step": "DeltaRuleState::step loop",
                        "EigenLoop": "per-token Eigen loop (baseline)"}[form]
                if form == "Streamed" and variant == "GatedDeltaNet":
                    path += " (the default)"
                per_token = (f" ({e['seconds'] / n * 1e6:.3g} us a token)"
                             if form in ("Step", "EigenLoop") else "")
                rows.append([dim, n, path, fmt_time(e["seconds"]) + per_token,
                             f"{e['FLOPS'] / 1e9:.1f}",
                             f"{100 * e['FLOPS'] / peak:.0f}%" if peak else "-",
                             f"{loop['seconds'] / e['seconds']:.2f}" if loop else "-"])
    text = "### The delta rule, Dk = Dv = D, float, one head, one thread (bench_delta)\n\n"
    if gemm:
        text += f"Eigen float GEMM 512^3: {gemm['FLOPS'] / 1e9:.1f} GFLOP/s (the 100% below).\n\n"
    text += table(["D", "N", "path", "time", "GFLOP/s", "% sgemm", "x Eigen loop"], rows)
    text += ("\n\nUseful FLOPs are the recurrence's, 6 Dk Dv per token. DeltaNet: no gates; Gated "
             "DeltaNet: a scalar log gate per token; KDA: one per key feature. The streamed form "
             "does the recurrence's FLOPs and no more, the chunked form's GEMMs 1.6-2x as many; "
             "DeltaForm::automatic runs the streamed one.\n\n")
    return text


POOL_NAME = re.compile(r"^BM_(PoolStep|StreamCopy|StateStep)_?(\w*)<(\w+)>(?:/(\d+))?(?:/(\d+))?/real_time$")


def pool_section(path):
    """Decoding many sessions (bench_pool): one SessionPool::step_into for every session of a
    16-head layer, its state bytes per second against a copy of as many bytes (BM_StreamCopy)
    on as many threads."""
    data = read_json(path)
    if data is None:
        return ""
    pool, copy, single = {}, {}, {}
    for b in data.get("benchmarks", []):
        if b.get("run_type", "iteration") != "iteration":
            continue
        m = POOL_NAME.match(b["name"])
        if not m:
            continue
        kind, shape, _, first, threads = m.groups()
        if kind == "PoolStep":
            pool[(shape, int(threads), int(first))] = b
        elif kind == "StreamCopy":
            copy[(round(b["state_MiB"] * 2**20), int(threads))] = b
        else:
            single[shape] = b
    if not pool:
        return ""
    text = ("### Decoding many sessions: SessionPool::step_into against a copy "
            "(bench_pool, float)\n\n")
    for shape in sorted({k[0] for k in pool}):
        for threads in sorted({k[1] for k in pool if k[0] == shape}):
            rows = []
            for sessions in sorted(k[2] for k in pool if k[0] == shape and k[1] == threads):
                b = pool[(shape, threads, sessions)]
                c = copy.get((round(b["state_MiB"] * 2**20), threads))
                state = b["state_GBps"] / 1e9
                rows.append([sessions, f"{b['state_MiB']:.3g}", f"{b['tokens_per_s'] / 1e3:.1f}k",
                             f"{state:.1f}", f"{c['copy_GBps'] / 1e9:.1f}" if c else "-",
                             f"{b['state_GBps'] / c['copy_GBps']:.2f}" if c else "-",
                             f"{b['per_head'] * 1e9:.0f}"])
            text += f"{shape}, {threads} thread{'s' if threads > 1 else ''}:\n\n"
            text += table([f"sessions", "state MiB", "tokens/s", "state GB/s", "copy GB/s",
                           "ratio", "ns per head"], rows) + "\n\n"
    if single:
        text += ("One state stepped again and again in cache (BM_StateStep): " +
                 ", ".join(f"{shape} {b['per_head'] * 1e9:.0f} ns"
                           for shape, b in sorted(single.items())) + ".\n\n")
    text += ("C64: C = Dv = 64, featurized inputs, default Options (S and z, 16.25 KiB a head); "
             "Delta128: Gated DeltaNet, Dk = Dv = 128 (S, 64 KiB a head). State GB/s counts "
             "the minimum a step moves, every state read and written once; copy GB/s is a "
             "std::copy of as many bytes on as many threads; ratio = state / copy. Target: at "
             "least 0.7 once the states pass the L3 (32 MiB).\n\n")
    return text


def run_note(path):
    """When and where the run was: Google Benchmark's context of bench_causal's JSON (the date,
    the CPUs, the load average as the binary started), so a table is never read without it."""
    data = read_json(path)
    if data is None:
        return ""
    ctx = data.get("context", {})
    load = ctx.get("load_avg") or []
    text = f"Run of {ctx.get('date', '?')} on {ctx.get('num_cpus', '?')} CPUs"
    if ctx.get("mhz_per_cpu"):
        text += f" at {ctx['mhz_per_cpu']} MHz"
    if load:
        text += ", load average " + ", ".join(f"{x:.2f}" for x in load) + " as bench_causal started"
    text += (". Rates move 10-20% from run to run on a shared machine: read each against the "
             "same run's Eigen GEMM.\n\n")
    return text


def main():
    bench_dir = sys.argv[1] if len(sys.argv) > 1 else "build/release/bench"
    causal = load(os.path.join(bench_dir, "causal.json"))
    decode = load(os.path.join(bench_dir, "decode.json"))
    features = load(os.path.join(bench_dir, "feature_maps.json"))
    backward = load(os.path.join(bench_dir, "backward.json"))
    gated = load(os.path.join(bench_dir, "gated.json"))
    causal_rows, decode_rows = [], []
    text = "## linattn benchmark results\n\n"
    text += run_note(os.path.join(bench_dir, "causal.json"))
    for scalar in ("float", "double"):
        text += causal_section(causal, scalar, causal_rows)
    text += half_section(causal)
    for scalar in ("float", "double"):
        text += backward_section(backward, scalar)
    text += backward_ratio_section(backward)
    for scalar in ("float", "double"):
        text += decode_section(decode, scalar, decode_rows)
    text += gated_section(gated)
    text += gated_heads_section(gated)
    text += delta_section(load(os.path.join(bench_dir, "delta.json")))
    text += feature_section(features)
    text += threads_section(os.path.join(bench_dir, "threads.json"))
    text += pool_section(os.path.join(bench_dir, "pool.json"))
    text += compile_section(os.path.join(bench_dir, "compile_cost.json"))
    with open(os.path.join(bench_dir, "report.md"), "w") as f:
        f.write(text)
    print(text)
    plot(bench_dir, causal_rows, decode_rows)


if __name__ == "__main__":
    main()
