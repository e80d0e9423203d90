"""Who sends how much to whom: a plan's rank x rank traffic matrix, as numbers and as a heatmap.

``triton-reshard demo --plot PATH`` and ``triton-reshard plan --plot PATH`` write the picture (matplotlib,
from the ``test`` extra). Row = sending rank, column = receiving rank, colour = bytes over the whole refit;
the diagonal is what a rank copies into itself (never on the wire).
"""

from __future__ import annotations

import numpy as np


def traffic_matrix(plan) -> tuple[list[int], np.ndarray]:
    """``(ranks, M)``: ``M[i, j]`` = bytes rank ``ranks[i]`` sends rank ``ranks[j]`` (relays included); the
    diagonal holds each rank's local copies."""
    ranks = list(plan.ranks)
    idx = {r: i for i, r in enumerate(ranks)}
    m = np.zeros((len(ranks), len(ranks)), dtype=np.float64)
    for t in plan.transfers + plan.local_copies:
        m[idx[t.src_rank], idx[t.dst_rank]] += t.nbytes
    return ranks, m


def plot_traffic(plan, path: str, title: str = "", subtitle: str = "") -> str:
    """Write the traffic heatmap of ``plan`` to ``path`` (PNG/SVG/PDF by its suffix); returns ``path``.
    Raises ``ImportError`` without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    ranks, m = traffic_matrix(plan)
    n = len(ranks)
    mib = m / (1 << 20)
    side = min(12.0, 3.5 + 0.32 * n)
    fig, ax = plt.subplots(figsize=(side + 1.6, side))
    shown = np.ma.masked_where(mib <= 0, mib)
    pos = mib[mib > 0]
    norm = LogNorm(vmin=max(pos.min(), pos.max() / 1e4), vmax=pos.max()) if pos.size else None
    im = ax.imshow(shown, cmap="viridis", norm=norm, interpolation="nearest")
    ax.set_facecolor("#f2f2f2")
    cb = fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    cb.set_label("MiB sent over one refit (log scale; blank: nothing)")
    step = max(1, n // 16)
    ticks = list(range(0, n, step))
    ax.set_xticks(ticks, [str(ranks[i]) for i in ticks])
    ax.set_yticks(ticks, [str(ranks[i]) for i in ticks])
    ax.set_xlabel("receiving rank")
    ax.set_ylabel("sending rank")
    if n <= 16:
        for i in range(n):
            for j in range(n):
                if mib[i, j] > 0:
                    v = mib[i, j]
                    label = f"{v:.0f}" if v >= 10 else f"{v:.1f}" if v >= 0.1 else f"{v:.2g}"
                    ax.text(j, i, label, ha="center", va="center",
                            fontsize=7 if n > 8 else 8, color="white" if norm and norm(v) < 0.6 else "black")
    for i in range(n):  # the diagonal: local copies, outlined
        ax.add_patch(plt.Rectangle((i - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="crimson", linewidth=1.2))
    st = plan.stats()
    wire, local, lb = st.wire_bytes, st.local_bytes, st.lower_bound_bytes
    foot = (f"on the wire {wire / (1 << 20):.0f} MiB (lower bound {lb / (1 << 20):.0f} MiB), "
            f"outlined diagonal = local copies {local / (1 << 20):.0f} MiB")
    ax.set_title("\n".join(x for x in (title or "who sends how much to whom", subtitle, foot) if x), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
