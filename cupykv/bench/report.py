"""What the bench writes: the environment record, the printed table and the figure.

The figure is drawn on a bare ``matplotlib.figure.Figure`` (the Agg canvas,
no pyplot), so writing the PNG never changes the caller's matplotlib backend
and the notebooks can draw the same panels from a stored JSON.
"""
from __future__ import annotations

import datetime
import platform
import textwrap

import numpy as np

import cupykv

EMULATOR_LABEL = "emulator timings: CPU emulation, NOT GPU figures"
EMULATOR_TITLE = "emulator smoke run, not GPU figures"


def environment(backend) -> dict:
    """Device, driver, CUDA, CuPy, NumPy and Python versions, and the date (UTC)."""
    device = backend.device_info()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cupykv_version": cupykv.__version__,
        "numpy_version": np.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "cupy_version": None,
        "driver_version": None,
        "cuda_runtime_version": None,
        **device.details,
        "device": device.name,
    }


def _fmt(value, digits=3) -> str:
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def table(data: dict) -> str:
    """A short plain-text table of every section's figures."""
    sections = data["sections"]
    lines = [data["label"], f"backend {data['backend']}, device {data['environment']['device']}, "
                            f"mode {data['mode']}, {data['wall_s']:.1f} s"]

    def block(name, columns):
        section = sections.get(name, {})
        if section.get("status") != "ok":
            lines.append(f"{name}: {section.get('status', 'missing')}: {section.get('reason', '')}")
            return
        lines.append(f"{name}:")
        lines.append("  " + "  ".join(f"{column:>12}" for column in columns))
        for row in section["results"]:
            lines.append("  " + "  ".join(f"{_fmt(row[column]):>12}" for column in columns))

    block("copy", ("bytes_moved", "time_ms", "bandwidth_GBps"))
    block("attention_decode", ("batch", "live_len", "time_ms", "bandwidth_GBps", "pct_of_copy"))
    block("attention_shapes", ("batch", "group", "live_len", "q_len", "rows_per_block", "time_ms", "pct_of_copy",
                               "TFLOPS", "time_vs_q_len_1", "time_vs_32_row_blocks"))
    block("attention_head_dim_256", ("batch", "group", "live_len", "q_len", "rows_per_block", "time_ms", "pct_of_copy",
                                     "TFLOPS", "time_vs_q_len_1"))
    block("attention_fp8", ("batch", "group", "live_len", "bf16_time_ms", "fp8_time_ms", "fp8_speedup",
                            "fp8_pct_of_copy"))
    block("full_axis", ("live_len", "cupykv_time_ms", "baseline_time_ms", "ratio_baseline_over_cupykv"))
    block("linear", ("out_features", "in_features", "rows", "time_ms", "bandwidth_GBps", "pct_of_copy"))
    block("model_decode", ("eager_time_ms", "graph_time_ms", "ratio_eager_over_graph"))
    block("smollm2_decode", ("batch", "eager_tokens_per_s", "graph_tokens_per_s"))
    block("decode_loops", ("batch", "mode", "time_per_token_ms", "tokens_per_s", "speedup_over_1"))
    block("traffic", ("what", "sectors_per_request", "sectors_over_ideal", "requested_over_ideal"))
    lines += peers_lines(sections.get("peers", {}))
    failed = [check["what"] for check in all_checks(data) if not check["passed"]]
    lines.append(f"checks: {'all passed' if not failed else 'FAILED: ' + '; '.join(failed)}")
    return "\n".join(lines)


def all_checks(data: dict) -> list[dict]:
    """Every correctness check of every section."""
    return [check for section in data["sections"].values() for check in section.get("checks", [])]


def _skipped(ax, title, section):
    ax.set_title(title)
    reason = section.get("reason", section.get("status", "missing"))
    ax.text(0.5, 0.5, "\n".join(textwrap.wrap(str(reason), 40)), ha="center", va="center",
            transform=ax.transAxes, fontsize=8)
    ax.set_axis_off()


def _copy_line(ax, data):
    copy = data["sections"].get("copy", {})
    if copy.get("status") == "ok":
        ax.axhline(copy["results"][0]["bandwidth_GBps"], color="black", linestyle="--", linewidth=1,
                   label="copy (read + write)")


def figure(data: dict, fig=None):
    """Draw one panel per section, titled with backend and device; returns the figure.

    Parameters
    ----------
    data : dict
        A parsed ``bench.json``.
    fig : matplotlib.figure.Figure, optional
        Drawn into (e.g. ``plt.figure(figsize=(16, 13), layout="constrained")`` in
        a notebook); by default a new bare ``Figure`` that no pyplot backend sees.
    """
    if fig is None:
        from matplotlib.figure import Figure
        fig = Figure(figsize=(16, 13), layout="constrained")
    sections = data["sections"]
    axes = fig.subplot_mosaic([["att", "full", "smollm2"], ["lin", "model", "e2e"], ["peers", "peers", "peers"]],
                              height_ratios=(1, 1, 1.2))
    ax_att, ax_full, ax_smollm2, ax_lin, ax_model = (axes[k] for k in ("att", "full", "smollm2", "lin", "model"))
    title = f"cupykv bench: {data['backend']} on {data['environment']['device']}"
    if not data.get("is_gpu_figures"):
        title += f"\n{EMULATOR_TITLE}"
    fig.suptitle(title)

    att = sections.get("attention_decode", {})
    if att.get("status") == "ok":
        for batch in att["params"]["batches"]:
            rows = [r for r in att["results"] if r["batch"] == batch]
            ax_att.plot([r["live_len"] for r in rows], [r["bandwidth_GBps"] for r in rows], "o-", label=f"batch {batch}")
        _copy_line(ax_att, data)
        ax_att.set(xscale="log", yscale="log", xlabel="live length (keys attended)", ylabel="GB/s (live K+V read)",
                   title="decode attention bandwidth")
        ax_att.legend(fontsize=8)
    else:
        _skipped(ax_att, "decode attention bandwidth", att)

    full = sections.get("full_axis", {})
    if full.get("status") == "ok":
        lives = [r["live_len"] for r in full["results"]]
        ax_full.plot(lives, [r["cupykv_time_ms"] for r in full["results"]], "o-", label="cupykv (live rows)")
        ax_full.plot(lives, [r["baseline_time_ms"] for r in full["results"]], "s-",
                     label=f"whole axis ({full['params']['baseline_dtype']} matmul)")
        for r in full["results"]:
            ax_full.annotate(f"{r['ratio_baseline_over_cupykv']:.2g}x", (r["live_len"], r["baseline_time_ms"]),
                             textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
        ax_full.axvline(full["params"]["highlight_live_len"], color="gray", linestyle=":", linewidth=1,
                        label="max_seq / 8")
        ax_full.margins(y=0.2)
        ax_full.set(xscale="log", yscale="log", xlabel=f"live length (max_seq {full['params']['max_seq']})",
                    ylabel="ms (median)", title=f"live length vs full axis, batch {full['params']['batch']}")
        ax_full.legend(fontsize=8)
    else:
        _skipped(ax_full, "live length vs full axis", full)

    lin = sections.get("linear", {})
    if lin.get("status") == "ok":
        for out_features, in_features in lin["params"]["weight_shapes"]:
            rows = [r for r in lin["results"] if (r["out_features"], r["in_features"]) == (out_features, in_features)]
            ax_lin.plot([r["rows"] for r in rows], [r["bandwidth_GBps"] for r in rows], "o-",
                        label=f"W {out_features}x{in_features}")
        _copy_line(ax_lin, data)
        ax_lin.set(xscale="log", yscale="log", xlabel="rows of x", ylabel="GB/s (bytes of W)", title="cupykv.linear bandwidth")
        ax_lin.legend(fontsize=8)
    else:
        _skipped(ax_lin, "cupykv.linear bandwidth", lin)

    model = sections.get("model_decode", {})
    if model.get("status") == "ok":
        row = model["results"][0]
        ax_model.bar(["eager", "graph"], [row["eager_time_ms"], row["graph_time_ms"]])
        ax_model.set(ylabel="ms per decode step (median)",
                     title=f"model decode step (eager / graph = {row['ratio_eager_over_graph']:.2f})")
    else:
        _skipped(ax_model, "model decode step", model)

    smollm2 = sections.get("smollm2_decode", {})
    if smollm2.get("status") == "ok":
        batches = [str(r["batch"]) for r in smollm2["results"]]
        positions = range(len(batches))
        ax_smollm2.bar([p - 0.2 for p in positions], [r["eager_tokens_per_s"] for r in smollm2["results"]], 0.4,
                       label="eager")
        ax_smollm2.bar([p + 0.2 for p in positions], [r["graph_tokens_per_s"] for r in smollm2["results"]], 0.4,
                       label="graph")
        ax_smollm2.set_xticks(list(positions), batches)
        ax_smollm2.set(xlabel="batch", ylabel="new tokens per second", title="SmolLM2-135M shape, random weights")
        ax_smollm2.legend(fontsize=8)
    else:
        _skipped(ax_smollm2, "SmolLM2-135M shape", smollm2)
    _peers_attention(axes["peers"], sections.get("peers", {}))
    _peers_end_to_end(axes["e2e"], sections.get("peers", {}))
    return fig


def write_png(data: dict, path) -> None:
    """Draw :func:`figure` into a PNG file."""
    figure(data).savefig(path, dpi=100)


# -- the peers section ---------------------------------------------------------------
PEER_IMPLS = ("cupykv", "flash", "efficient", "cudnn", "math")


def peers_lines(section: dict) -> list[str]:
    """The table's lines for the peers section: per case cupykv against the fastest torch backend."""
    if section.get("status") != "ok":
        return [f"peers: {section.get('status', 'missing')}: {section.get('reason', '')}"]
    lines = [f"peers ({section['label']}):"]
    rows = section["results"]
    if section["timed"]:
        lines.append("  " + "  ".join(f"{c:>12}" for c in ("batch", "live_len", "group", "q_len", "cupykv_ms",
                                                             "torch_best", "torch_ms", "speedup")))
        for row in rows:
            figures = (row["batch"], row["live_len"], row["group"], row["q_len"], row.get("cupykv_time_ms", "-"),
                       row.get("fastest_torch", "-"), row.get("fastest_torch_time_ms", "-"),
                       row.get("speedup_over_fastest_torch", "-"))
            lines.append("  " + "  ".join(f"{_fmt(value):>12}" for value in figures))
    else:
        worst = max((error for row in rows for error in row["error_over_tolerance"].values()), default=0.0)
        lines.append(f"  {len(rows)} attention cases, largest error / tolerance {worst:.3g} (no times)")
    e2e = section.get("end_to_end", {})
    if e2e.get("status") != "ok":
        lines.append(f"  end to end: {e2e.get('status', 'missing')}: {e2e.get('reason', '')}")
    elif section["timed"]:
        for row in e2e["results"]:
            rates = ", ".join(f"{impl} {row[f'{impl}_tokens_per_s']:.4g}"
                              for impl in ("cupykv", "hf_eager", "hf_compiled") if f"{impl}_tokens_per_s" in row)
            lines.append(f"  end to end, batch {row['batch']}: tokens/s {rates}")
    else:
        lines.append(f"  end to end: batches {e2e['params']['batches']}, tokens compared (no times)")
    return lines


def _peers_attention(ax, section: dict) -> None:
    """Per case, cupykv's bar beside each torch backend's: % of copy bandwidth (timed) or error / tolerance."""
    title = "decode attention: cupykv and torch SDPA backends, same buffers"
    if section.get("status") != "ok" or not section.get("results"):
        _skipped(ax, title, section)
        return
    rows = section["results"]
    timed = section["timed"]
    impls = [impl for impl in PEER_IMPLS if any(impl in row["error_over_tolerance"] for row in rows)]
    width = 0.8 / len(impls)
    for n, impl in enumerate(impls):
        values = [(row.get(f"{impl}_pct_of_copy") if timed else row["error_over_tolerance"].get(impl)) or 0.0
                  for row in rows]
        ax.bar([i + (n - (len(impls) - 1) / 2) * width for i in range(len(rows))], values, width, label=impl)
    if timed:
        for i, row in enumerate(rows):
            if "speedup_over_fastest_torch" in row:
                ax.annotate(f"{row['speedup_over_fastest_torch']:.2g}x",
                            (i - (len(impls) - 1) / 2 * width, row.get("cupykv_pct_of_copy") or 0.0),
                            textcoords="offset points", xytext=(0, 4), ha="center", fontsize=6)
        ax.set(ylabel="% of copy bandwidth (live K+V / time)", title=title + " (label: cupykv over fastest torch)")
    else:
        ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
        ax.set(ylabel="error / stated tolerance (<= 1 passes)", title=f"{title}: {section['label']}")
    short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
    labels = [f"{short.get(row['dtype'], row['dtype'])} {row['layout']} b{row['batch']} L{row['live_len']} "
              f"g{row['group']} q{row['q_len']}" for row in rows]
    ax.set_xticks(range(len(rows)), labels, rotation=90, fontsize=6)
    ax.legend(fontsize=7, ncol=len(impls))


def _peers_end_to_end(ax, section: dict) -> None:
    """Tokens/s per batch of cupykv graph decode, transformers eager and compiled."""
    title = "end to end: cupykv vs transformers"
    e2e = section.get("end_to_end", {}) if section.get("status") == "ok" else section
    if e2e.get("status") != "ok" or not section.get("timed"):
        reason = e2e.get("reason") if e2e.get("status") != "ok" else \
            f"{section['label']}: tokens " + ("identical" if all(c["passed"] for c in e2e["checks"]) else "DIFFER")
        _skipped(ax, title, {"reason": reason})
        return
    rows = e2e["results"]
    impls = [impl for impl in ("cupykv", "hf_eager", "hf_compiled") if any(f"{impl}_tokens_per_s" in r for r in rows)]
    width = 0.8 / max(1, len(impls))
    for n, impl in enumerate(impls):
        ax.bar([i + (n - (len(impls) - 1) / 2) * width for i in range(len(rows))],
               [row.get(f"{impl}_tokens_per_s", 0.0) for row in rows], width, label=impl)
    ax.set_xticks(range(len(rows)), [str(row["batch"]) for row in rows])
    ax.set(xlabel="batch", ylabel="new tokens per second", title=title + " (SmolLM2 shape)")
    ax.legend(fontsize=8)

