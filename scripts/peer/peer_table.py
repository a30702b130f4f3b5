#!/usr/bin/env python3
"""One table from several `inferscale loadtest --json` reports of the same
request stream (the peer benchmark, scripts/gpu_peer_bench.sh): a row per
engine, mode and client count with req/s, output tok/s, TTFT and
end-to-end p50/p99, and the ratios the speed issue asks for at each client
count. Writes the Markdown table to stdout and, with --json, the rows.

    peer_table.py [--json OUT.json] LABEL=REPORT.json LABEL=REPORT.json …
"""
import json
import sys


def rows(label, path):
    report = json.load(open(path, encoding="utf-8"))
    for p in report["points"]:
        yield {
            "engine": label,
            "mode": p["mode"],
            "k": p["k"],
            "users": p["users"],
            "requests": p["requests"],
            "errors": p["errors"],
            "requests_per_s": p["requests_per_s"],
            "output_tokens_per_s": p["output_tokens_per_s"],
            "ttft_ms_p50": p["ttft_ms"]["p50"],
            "ttft_ms_p99": p["ttft_ms"]["p99"],
            "e2e_ms_p50": p["e2e_ms"]["p50"],
            "e2e_ms_p99": p["e2e_ms"]["p99"],
        }


def ms(v):
    return f"{v / 1e3:.1f} s" if v >= 10_000 else f"{v:.0f} ms" if v >= 100 else f"{v:.1f} ms"


def main(argv):
    out_json = None
    if argv[:1] == ["--json"]:
        out_json, argv = argv[1], argv[2:]
    if not argv or any("=" not in a for a in argv):
        sys.exit(__doc__)
    table = [r for a in argv for r in rows(*a.split("=", 1))]
    table.sort(key=lambda r: (r["k"], r["users"], r["engine"], r["mode"]))
    print("| engine | mode | k | clients | requests | errors | req/s | out tok/s | TTFT p50 | TTFT p99 | e2e p50 | e2e p99 |")
    print("|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for r in table:
        print(f"| {r['engine']} | {r['mode']} | {r['k']} | {r['users']} | {r['requests']} | {r['errors']} | "
              f"{r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.1f} | {ms(r['ttft_ms_p50'])} | "
              f"{ms(r['ttft_ms_p99'])} | {ms(r['e2e_ms_p50'])} | {ms(r['e2e_ms_p99'])} |")
    # The ratios of the speed issue's targets, where both sides were measured.
    rate = {(r["engine"], r["mode"], r["k"], r["users"]): r["requests_per_s"] for r in table}
    engines = [a.split("=", 1)[0] for a in argv]
    if len(engines) >= 2:
        a, b = engines[0], engines[1]
        print(f"\nRatios of req/s, {a} over {b}:\n")
        print(f"| k | clients | {a} kv / {b} kv | {a} prompt / {b} prompt | {a} kv / {b} prompt |")
        print("|--:|--:|--:|--:|--:|")
        def ratio(x, y):
            num, den = rate.get(x), rate.get(y)
            return f"{num / den:.2f}" if num is not None and den else "–"

        for k, users in sorted({(r["k"], r["users"]) for r in table}):
            if not all(any((e, m, k, users) in rate for m in ("kv", "prompt")) for e in (a, b)):
                continue  # one side did not measure this point
            print(f"| {k} | {users} | {ratio((a, 'kv', k, users), (b, 'kv', k, users))} | "
                  f"{ratio((a, 'prompt', k, users), (b, 'prompt', k, users))} | "
                  f"{ratio((a, 'kv', k, users), (b, 'prompt', k, users))} |")
    if out_json:
        with open(out_json, "w", encoding="utf-8") as f:
            json.dump({"sources": dict(a.split("=", 1) for a in argv), "rows": table}, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1:])
