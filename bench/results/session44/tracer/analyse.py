"""Session 44: where a small caller's time goes beside large ones (records of sitecustomize.py).

    python analyse.py trace.jsonl
"""
import json
import statistics
import sys

recs = [json.loads(line) for line in open(sys.argv[1])]
subs = [r for r in recs if r["kind"] == "submit"]
hands = sorted((r for r in recs if r["kind"] == "handler"), key=lambda r: r["h0"])
answers = [r for r in recs if r["kind"] == "answer"]
large = [r for r in subs if r["rows"] > 256]
lo, hi = (min(r["s0"] for r in large), max(r["s1"] for r in large)) if large else (0, 0)


def within(inner0, inner1, outer0, outer1):
    return outer0 <= inner0 and inner1 <= outer1


def med(xs):
    return round(statistics.median(xs) / 1e3, 1) if xs else None


def p90(xs):
    return round(sorted(xs)[int(len(xs) * 0.9)] / 1e3, 1) if xs else None


for phase, keep in (("alone (no large call running)", lambda r: not (lo <= r["h0"] <= hi)),
                    ("beside large calls", lambda r: lo <= r["h0"] <= hi)):
    small = [h for h in hands if h["body"] < 65536 and keep(h)]
    seg = {k: [] for k in ("frame->task", "task->h0", "h0->s0", "s0->b0 (device wait)", "b0->b1 (batch)",
                           "b1->s1 (wake)", "s1->h1", "h1->a1 (to acceptor)", "h1->next h0 (outside)",
                           "h0->h1 (handler)")}
    threads, forwarded, batch_sizes = {}, 0, []
    for i, h in enumerate(small):
        s = next((x for x in subs if x["rows"] <= 256 and within(x["s0"], x["s1"], h["h0"], h["h1"])), None)
        # Its own forwarded answer, if any: the tightest record around it (the records carry no
        # body size; a large call's answer around a small call is far wider).
        around = [x for x in answers if within(h["h0"], h["h1"], x["task"], x["a1"])]
        a = min(around, key=lambda x: x["a1"] - x["task"]) if around else None
        if a is not None and a.get("body", 0) > 65536:
            a = None
        seg["h0->h1 (handler)"].append(h["h1"] - h["h0"])
        if i + 1 < len(small):
            seg["h1->next h0 (outside)"].append(small[i + 1]["h0"] - h["h1"])
        if a is not None:
            forwarded += 1
            seg["frame->task"].append(a["task"] - a["frame"])
            seg["task->h0"].append(h["h0"] - a["task"])
            seg["h1->a1 (to acceptor)"].append(a["a1"] - h["h1"])
        if s is not None:
            seg["h0->s0"].append(s["s0"] - h["h0"])
            seg["s1->h1"].append(h["h1"] - s["s1"])
            if "b0" in s:
                seg["s0->b0 (device wait)"].append(s["b0"] - s["s0"])
                seg["b0->b1 (batch)"].append(s["b1"] - s["b0"])
                seg["b1->s1 (wake)"].append(s["s1"] - s["b1"])
                threads[s["thr"]] = threads.get(s["thr"], 0) + 1
                batch_sizes.append(s["batch"])
    print(f"\n{phase}: {len(small)} small calls, {forwarded} forwarded by an acceptor, batch threads {threads}")
    for k, v in seg.items():
        print(f"  {k:26s} n={len(v):5d}  p50 {med(v)} us  p90 {p90(v)} us")
if large:
    lb = [r["b1"] - r["b0"] for r in large if "b0" in r]
    print(f"\nlarge calls: {len(large)}, their batches p50 {med(lb)} us, calls a batch p50 "
          f"{statistics.median([r['batch'] for r in large if 'batch' in r])}")
