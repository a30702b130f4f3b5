"""Agreement of `eval locomo` reports with a reference report: per mode, the
share of questions whose greedy answer is word for word the reference's, and
both mean F1s.  Usage: agreement.py REFERENCE.json OTHER.json [...]"""
import json, sys
def load(p):
    d = json.load(open(p))
    return {(a['sample'], a['question'], a['mode'], a['k']): a for a in d['answers']}
base = load(sys.argv[1])
for other in sys.argv[2:]:
    o = load(other)
    for mode in ('kv', 'prompt'):
        keys = [k for k in base if k[2] == mode and k in o]
        if not keys: continue
        same = sum(base[k]['answer'] == o[k]['answer'] for k in keys) / len(keys)
        f1b = sum(base[k]['f1'] for k in keys) / len(keys)
        f1o = sum(o[k]['f1'] for k in keys) / len(keys)
        kl = [o[k].get('kl_vs_prompt') for k in keys if o[k].get('kl_vs_prompt') is not None]
        print(f"{other}: {mode} n={len(keys)} agreement-with-base={same:.3f} F1 base={f1b:.3f} this={f1o:.3f}" + (f" kl_vs_prompt(this run)={sum(kl)/len(kl):.4f}" if kl else ""))
