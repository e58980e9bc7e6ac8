"""`mea-bench-serve`'s report: the median of each measurement over the rounds, MEA against its
original, as a table, a JSON-ready dict and (with matplotlib) a plot. Pure arithmetic on the
rounds `serve_rounds.run_round` returns; imports neither vLLM nor Megatron-Core.
"""

import statistics

EXPORTS = ("original", "mea")
# (round field, column title, format) of the summary; the ratios are MEA / original.
COLUMNS = (
    ("tokens_per_cpu_s", "out tok / server CPU-s", "{:.2f}"),
    ("tokens_per_s", "out tok / s (wall)", "{:.2f}"),
    ("running_max", "running max", "{:.0f}"),
    ("running_mean", "running mean", "{:.1f}"),
    ("engine_steps", "engine steps", "{:.0f}"),
    ("preemptions", "preemptions", "{:.0f}"),
)


def summarize(rounds):
    """{field: median over `rounds`} of every `COLUMNS` field, plus the tokens generated in
    all rounds and the wall and CPU seconds."""
    summary = {field: statistics.median(r[field] for r in rounds) for field, _, _ in COLUMNS}
    for field in ("output_tokens", "generated_tokens", "wall_s", "cpu_s"):
        summary[field] = sum(r[field] for r in rounds)
    return summary


def compare(case):
    """`case` (`{"exports": {"original": {...}, "mea": {...}}}`, each with `rounds` and
    `kv_tokens`) with each export's `summary`, the case's `ratios` (MEA / original of the
    medians) and `paired_ratios` (median of the rounds' MEA / original) added."""
    exports = case["exports"]
    for export in exports.values():
        export["summary"] = summarize(export["rounds"])
    original, mea = (exports[name] for name in EXPORTS)
    ratios = {"kv_tokens": mea["kv_tokens"] / original["kv_tokens"]}
    for field, _, _ in COLUMNS:
        base = original["summary"][field]
        ratios[field] = mea["summary"][field] / base if base else float("nan")
    case["ratios"] = ratios
    # The median of the rounds' own ratios: each pair ran back to back, under much the same
    # load from other jobs, where the load drifts between pairs.
    pairs = list(zip(original["rounds"], mea["rounds"]))
    case["paired_ratios"] = {
        field: statistics.median(m[field] / o[field] for o, m in pairs)
        for field in ("tokens_per_cpu_s", "tokens_per_s")}
    return case


def table(cases):
    """Markdown rows: per case and export the medians, the MEA row with its ratios."""
    head = ["case", "export", "KV tokens", *(title for _, title, _ in COLUMNS)]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for case in cases:
        for name in EXPORTS:
            export = case["exports"][name]
            cells = [case["name"], name, f"{export['kv_tokens']:,}"]
            for field, _, fmt in COLUMNS:
                cell = fmt.format(export["summary"][field])
                ratio = case["ratios"][field]
                if name == "mea" and ratio == ratio:  # not NaN: the original's is nonzero
                    cell += f" ({ratio:.2f}x)"
                cells.append(cell)
            if name == "mea":
                cells[2] += f" ({case['ratios']['kv_tokens']:.2f}x)"
            rows.append("| " + " | ".join(cells) + " |")
    return rows


def paired_table(cases):
    """Markdown rows: per case the MEA / original ratios of the medians and the median of the
    paired rounds' ratios, with the rounds' load average."""
    rows = ["| case | rounds | per CPU-s: medians | per CPU-s: paired | per s: medians "
            "| per s: paired | load |", "|---|---|---|---|---|---|---|"]
    for case in cases:
        ratios, paired = case["ratios"], case["paired_ratios"]
        loads = [r["load"] for e in case["exports"].values() for r in e["rounds"]]
        rows.append(f"| {case['name']} | {len(case['exports']['mea']['rounds'])} "
                    f"| {ratios['tokens_per_cpu_s']:.2f}x | {paired['tokens_per_cpu_s']:.2f}x "
                    f"| {ratios['tokens_per_s']:.2f}x | {paired['tokens_per_s']:.2f}x "
                    f"| {min(loads):.0f}-{max(loads):.0f} |")
    return rows


def vllm_bench_table(cases):
    """Markdown rows of vLLM's own client's runs (`--vllm-bench`), where the cases have them:
    its output tokens/s and those per server CPU-second, MEA against the original."""
    rows = ["| case | vLLM client: out tok/s, original | MEA | ratio | per server CPU-s, "
            "original | MEA | ratio |", "|---|---|---|---|---|---|---|"]
    for case in cases:
        runs = [case["exports"][name].get("vllm_bench") for name in EXPORTS]
        if None in runs:
            continue
        speed = [r["output_throughput"] for r in runs]
        per_cpu = [r["total_output_tokens"] / r["server_cpu_s"] for r in runs]
        rows.append(f"| {case['name']} | {speed[0]:.2f} | {speed[1]:.2f} "
                    f"| {speed[1] / speed[0]:.2f}x | {per_cpu[0]:.2f} | {per_cpu[1]:.2f} "
                    f"| {per_cpu[1] / per_cpu[0]:.2f}x |")
    return rows if len(rows) > 2 else []


def plot(cases, path):
    """Bars of the MEA / original ratios per case (tokens per CPU-second, per wall second, KV
    tokens), one dot per paired round; returns False where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fields = (("tokens_per_cpu_s", "out tok / CPU-s"), ("tokens_per_s", "out tok / s"))
    figure, axis = plt.subplots(figsize=(1.6 + 1.8 * len(cases), 3.6))
    width = 0.8 / (len(fields) + 1)
    for i, case in enumerate(cases):
        pairs = list(zip(*(case["exports"][name]["rounds"] for name in EXPORTS)))
        for j, (field, label) in enumerate(fields):
            x = i + (j - 1) * width
            axis.bar(x, case["ratios"][field], width, color=f"C{j}",
                     label=label if i == 0 else None)
            axis.plot([x] * len(pairs), [m[field] / o[field] for o, m in pairs], "k.", ms=4)
        axis.bar(i + width, case["ratios"]["kv_tokens"], width, color="C2",
                 label="KV tokens" if i == 0 else None)
    axis.axhline(1.0, color="gray", lw=0.8)
    axis.set_ylim(0, 1.35 * max(max(c["ratios"][f] for f in ("kv_tokens", "tokens_per_s",
                                                              "tokens_per_cpu_s"))
                                for c in cases))
    axis.set_xticks(range(len(cases)), [c["name"] for c in cases], fontsize=8)
    axis.set_ylabel("MEA / original (bars: median; dots: rounds)")
    axis.legend(fontsize=8, loc="upper left", ncols=3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True
