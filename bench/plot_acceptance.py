"""Per-position acceptance from a bench_pair.py JSON as a PNG: P(draft position k accepted) per verify step,
one line per (prompt set, temperature). usage: python bench/plot_acceptance.py RESULT.json OUT.png"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(argv: list[str]) -> None:
    src, out = argv
    result = json.loads(open(src).read())
    fig, ax = plt.subplots(figsize=(6, 4), dpi=110)
    for row in result["acceptance"]:
        k = range(1, len(row["per_position"]) + 1)
        ax.plot(k, row["per_position"], marker="o",
                label=f"{row['set']}, T={row['temperature']:g} (tau {row['tau']:.2f})")
    ax.set_xlabel("draft position k")
    ax.set_ylabel("P(position k accepted)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.set_title(f"demo drafter on held-out prompts ({result['device']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)


if __name__ == "__main__":
    main(sys.argv[1:])
