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
    block("full_axis", ("live_len", "cupykv_time_ms", "baseline_time_ms", "ratio_baseline_over_cupykv"))
    block("linear", ("out_features", "in_features", "rows", "time_ms", "bandwidth_GBps", "pct_of_copy"))
    block("model_decode", ("eager_time_ms", "graph_time_ms", "ratio_eager_over_graph"))
    block("smollm2_decode", ("batch", "eager_tokens_per_s", "graph_tokens_per_s"))
    block("decode_loops", ("batch", "mode", "time_per_token_ms", "tokens_per_s", "speedup_over_1"))
    block("traffic", ("what", "sectors_per_request", "sectors_over_ideal", "requested_over_ideal"))
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
        Drawn into (e.g. ``plt.figure(figsize=(16, 9), layout="constrained")`` in
        a notebook); by default a new bare ``Figure`` that no pyplot backend sees.
    """
    if fig is None:
        from matplotlib.figure import Figure
        fig = Figure(figsize=(16, 9), layout="constrained")
    sections = data["sections"]
    (ax_att, ax_full, ax_smollm2), (ax_lin, ax_model, ax_unused) = fig.subplots(2, 3)
    ax_unused.set_axis_off()
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
    return fig


def write_png(data: dict, path) -> None:
    """Draw :func:`figure` into a PNG file."""
    figure(data).savefig(path, dpi=100)
