#!/usr/bin/env python3
"""Rebuilds a summary-only locomo.json from a results table in docs/locomo.md,
so that `inferscale eval locomo --replot --out DIR` redraws the committed
chart after a change to the charts (the runs' own locomo.json holds answers
derived from the data set and is not committed).

    scripts/locomo_table_json.py docs/locomo.md "## Qwen2.5-Coder" OUT_DIR MODEL
    inferscale eval locomo --replot --out OUT_DIR

The first table after the heading that starts with the given text is read:
columns mode, window, k, F1, F1 cat 1..4, recall@k, TTFT ms (others ignored).
"""
import json
import os
import sys


def num(cell):
    cell = cell.strip().strip("*").replace(",", "")
    return None if cell in ("", "–", "-") else float(cell)


def main():
    doc, heading, out, model = sys.argv[1:5]
    lines = open(doc, encoding="utf-8").read().splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith(heading))
    head = next(i for i in range(start, len(lines)) if lines[i].startswith("| mode |"))
    cols = [c.strip() for c in lines[head].strip("|").split("|")]
    rows = []
    for line in lines[head + 2:]:
        if not line.startswith("|"):
            break
        cells = dict(zip(cols, [c.strip() for c in line.strip("|").split("|")]))
        mode = cells["mode"]
        if mode == "none":
            continue
        cats = {str(c): num(cells["F1 cat 1" if c == 1 else f"cat {c}"]) for c in (1, 2, 3, 4)}
        rows.append({
            "mode": mode,
            "window": None if num(cells["window"]) is None else int(num(cells["window"])),
            "k": int(num(cells["k"])),
            "n": 0,
            "f1": num(cells["F1"]),
            "f1_by_category": cats,
            "recall": num(cells["recall@k"]),
            "ttft_ms_median": num(cells["TTFT ms"]),
            "agreement": num(cells.get("agreement", "")),
            "kl_mean": num(cells.get("KL", "")),
        })
    report = {"data": f"{doc}: {heading}", "samples": [], "model": model, "retriever": None,
              "ingest": [], "summary": rows, "answers": []}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "locomo.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    print(f"{len(rows)} rows -> {out}/locomo.json")


if __name__ == "__main__":
    main()
