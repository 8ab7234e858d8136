#!/usr/bin/env python3
"""Runs adapt_model.rs (built at $MODEL, default /tmp/adapt-model) on the
traces of traces.py in $TRACES (default /tmp/traces) at reference.py's
sizes; prints per trace the model's hit % and its margin to the issue's
bar (best of exact LRU, ARC, S3-FIFO, W-TinyLFU, LIRS − 1 pp; IID Zipf:
hkvd lru − 0.3 pp), from the CSVs in shard/bench/results/. Variants: the
model's environment variables; J: runs at once (default 2); REF: another
reference CSV (a held-out trace seed's, say; default results/reference.csv).

    VAR=... python3 shard/bench/model_eval.py [trace ...]
"""
import csv, collections, subprocess, sys, os, concurrent.futures as cf
R=os.path.join(os.path.dirname(os.path.abspath(__file__)), 'results') + '/'
caps=collections.defaultdict(set); best=collections.defaultdict(float); lru={}
for r in csv.DictReader(open(os.environ.get('REF',R+'reference.csv'))):
    caps[r['trace']].add(int(r['capacity']))
    if r['policy'] in ('exact-lru','arc','s3fifo','w-tinylfu','lirs'):
        k=(r['trace'],int(r['capacity'])); best[k]=max(best[k],float(r['hit_percent']))
for f in ('hkvd-a.csv','hkvd-b.csv'):
    for r in csv.DictReader(open(R+f)):
        if r['policy']=='hkvd-lru': lru[(r['trace'],int(r['capacity']))]=float(r['hit_percent'])
traces=sys.argv[1:] or ['drift','drift-fast','scan-hot','bursts','loop-mix','mixture','zipf-0.5','zipf-0.75','zipf-1.0','zipf-1.25']
def one(t):
    c=sorted(caps[t])
    out=subprocess.run([os.environ.get('MODEL','/tmp/adapt-model'),os.path.join(os.environ.get('TRACES','/tmp/traces'),f'{t}.bin'),','.join(map(str,c))],capture_output=True,text=True).stdout.split()
    v=[float(x) for x in out]
    ref=[(lru if t.startswith('zipf') else best)[(t,x)]-(0.3 if t.startswith('zipf') else 1.0) for x in c]
    d=[a-b for a,b in zip(v,ref)]
    return t, v, d
with cf.ThreadPoolExecutor(int(os.environ.get('J','2'))) as ex:
    res=list(ex.map(one,traces))
worst=0
for t,v,d in res:
    print(f"{t:11s} "+" ".join(f"{x:6.2f}" for x in v)+" | margin "+" ".join(f"{x:+6.2f}" for x in d))
    worst+=sum(min(0,x) for x in d)
print(f"total shortfall {worst:.2f}")
