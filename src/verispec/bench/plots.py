"""PNG plots of a bench result (matplotlib, headless): speedup vs K with the predicted curve,
per-category speedup per mode, and acceptance by draft position."""

from __future__ import annotations

from pathlib import Path

from verispec.bench.costs import predicted_speedup
from verispec.errors import VerispecError


def write_plots(result: dict, out_dir: str | Path) -> list[Path]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise VerispecError("--plot needs matplotlib: pip install 'verispec[bench]'") from None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = [r for r in result["summary"] if r["category"] == "all"]
    costs = result["costs"]
    c_p = {int(n): v for n, v in costs["c_p"].items()}
    written = []

    # 1. Speedup vs K: measured points over the curve predicted from measured costs and α.
    fig, ax = plt.subplots(figsize=(6, 4))
    for (temp, bs) in sorted({(r["temperature"], r["batch_size"]) for r in rows}):
        for proposer, c_q in (("draft", costs.get("c_q_draft") or 0.0), ("ngram", 0.0)):
            pts = [(int(r["mode"].split("k=")[1]), r["speedup"], r.get("alpha")) for r in rows
                   if r["temperature"] == temp and r["batch_size"] == bs and r["mode"].startswith(proposer + " ")
                   and r["mode"].split("k=")[1].isdigit() and r["speedup"] is not None]
            if not pts:
                continue
            line = ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", label=f"{proposer} T={temp} bs={bs} measured")
            alphas = [p[2] for p in pts if p[2] is not None]
            ks = [k for k in range(1, max(c_p)) if k + 1 in c_p]
            if alphas and ks:
                a = sum(alphas) / len(alphas)
                ax.plot(ks, [predicted_speedup(a, k, c_q, c_p) for k in ks], "-", color=line[0].get_color(),
                        alpha=0.6, label=f"{proposer} predicted (α={a:.2f})")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xlabel="K (draft tokens per round)", ylabel="speedup vs plain", title="Speedup vs K")
    ax.legend(fontsize=7)
    written.append(_save(fig, out / "speedup_vs_k.png"))

    # 2. Per-category speedup bars, one group per category, one bar per mode.
    cats = [r for r in result["summary"] if r["category"] != "all" and r["mode"] != "plain"]
    if cats:
        fig, ax = plt.subplots(figsize=(8, 4))
        categories = sorted({r["category"] for r in cats})
        modes = sorted({(r["mode"], r["temperature"]) for r in cats})
        width = 0.8 / max(1, len(modes))
        for i, (mode, temp) in enumerate(modes):
            ys = [next((r["speedup"] or 0 for r in cats if r["category"] == c and r["mode"] == mode
                        and r["temperature"] == temp), 0) for c in categories]
            ax.bar([x + i * width for x in range(len(categories))], ys, width, label=f"{mode} T={temp}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(categories))], categories, rotation=20, fontsize=8)
        ax.set(ylabel="speedup vs plain", title="Speedup by category")
        ax.legend(fontsize=6, ncol=2)
        written.append(_save(fig, out / "speedup_by_category.png"))

    # 3. Acceptance by draft position.
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        pos = r.get("per_position_acceptance") or []
        if pos:
            ax.plot(range(len(pos)), [p if p is not None else float("nan") for p in pos], "o-",
                    label=f"{r['mode']} T={r['temperature']}")
    ax.set(xlabel="draft position i", ylabel="share of rounds accepting draft i", ylim=(0, 1.05),
           title="Acceptance by draft position")
    ax.legend(fontsize=7)
    written.append(_save(fig, out / "acceptance_by_position.png"))
    return written


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path
