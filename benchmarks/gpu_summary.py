"""The GPU check's figures in a few lines, from the JSON files gpu_check.sh wrote.

    python3 benchmarks/gpu_summary.py DIR

Prints, per file: the card, driver and torch; for vs_tune-*.json each sweep's
wall times, (a)/(b) (against plain Tune's fastest card share), its ratio per
member-epoch, member-epochs and best accuracies; for share_card.json each
share's wall time against one bucket per card; for fused_step*.json each
variant's eager/fused ratio (the eager loop uncompiled; against compiled eager
models too where measured). A file from a part that was cut short says so.
"""
from __future__ import annotations

import glob
import json
import os
import sys


def where(d: dict) -> str:
    return (f"{d.get('device_name') or d.get('device')}, driver {d.get('driver')}, torch {d.get('torch')}"
            f" (CUDA {d.get('torch_cuda')})")


def vs_tune(path: str, d: dict) -> None:
    print(f"{os.path.basename(path)}: {where(d)}" + ("" if d.get("complete") else "  [INCOMPLETE]"))
    for row in d["rows"]:
        if "median_wall_s" not in row:
            continue  # no timed run of this row finished
        wall, best, hit = row["median_wall_s"], row["best"], row.get("budget_hit", {})
        cells = "  ".join(f"{w} {wall[w]:.1f} s{'+' if hit.get(w) else ''} best {best[w]:.3f}" for w in wall)
        # (a) is plain Tune at its fastest card share where several ran (plain@f).
        ratio = (f"  (a)/(b) {row['plain_over_chorus']:.2f}x" + (f" [(a) = {row['plain_way']}]"
                 if "@" in row.get("plain_way", "") else "")) if "plain_over_chorus" in row else ""
        per = (f", per member-epoch {row['plain_over_chorus_per_member_epoch']:.2f}x"
               if "plain_over_chorus_per_member_epoch" in row else "")
        gap = f"  best gap {row['best_plain_minus_chorus']:+.3f}" if "best_plain_minus_chorus" in row else ""
        gap += " (a side hit its time budget)" if "best_gap_caveat" in row else ""
        print(f"  {row['workload']} {row['trials']} trials {row['scheduler']} {row['epochs']} ep: "
              f"{cells}{ratio}{per}{gap}")
        if row.get("member_epochs"):
            print("    member-epochs " + ", ".join(f"{w} {n:g}" for w, n in row["member_epochs"].items()
                                                  if n is not None))
    if any(any(row.get("budget_hit", {}).values()) for row in d["rows"]):
        print("  +: hit the time budget (a lower bound; its trials did not all finish)")


def share_card(path: str, d: dict) -> None:
    incomplete = "" if d.get("complete") else "  [INCOMPLETE]"
    print(f"{os.path.basename(path)}: {where(d)}, {d['trials']} trials{incomplete}")
    ratios = d.get("first_over_share", {})
    for share, wall in d["median_wall_s"].items():
        bests = [r["best"] for r in d["runs"] if str(r["gpu_per_bucket"]) == share]
        hit = any(r["budget_hit"] for r in d["runs"] if str(r["gpu_per_bucket"]) == share)
        print(f"  GPU/bucket {share:>5}: {wall:6.1f} s{'+' if hit else ''}  1-per-card/this "
              f"{ratios.get(share, float('nan')):.2f}x  best {max(bests):.3f}")


def fused_step(path: str, d: dict) -> None:
    print(f"{os.path.basename(path)}: {where(d)}, {d['steps']} steps, variants {d.get('variants')}")
    for row in d["rows"]:
        if "variants" in row:
            cells = "  ".join(f"{v} {x['ratio']:.2f}x ({x['route']}, {x['first_over_this']:.2f}x of first)"
                              for v, x in row["variants"].items())
        else:
            cells = f"{row['ratio']:.2f}x ({row['route']})"
        print(f"  {row['model']} K={row['k']}: eager/fused {cells}")
        if "ratio_vs_compiled_eager" in row:
            print("    compiled eager/fused " + "  ".join(f"{v} {r:.2f}x"
                                                          for v, r in row["ratio_vs_compiled_eager"].items()))


def main() -> None:
    folder = sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/gpu_check"
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        try:
            with open(path) as fh:
                d = json.load(fh)
            name = os.path.basename(path)
            if name.startswith("vs_tune"):
                vs_tune(path, d)
            elif name.startswith("share_card"):
                share_card(path, d)
            elif name.startswith("fused_step"):
                fused_step(path, d)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"{path}: unreadable ({type(exc).__name__}: {exc})")


if __name__ == "__main__":
    main()
