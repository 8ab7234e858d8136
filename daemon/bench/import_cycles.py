"""Draws the module import graph of a crate's src/ (every crate::, super:: and self:: path of each file, comments and test modules left out; a module seeing its ancestors is not counted) and prints its import circles: python3 daemon/bench/import_cycles.py daemon/src"""
import os, re, sys
root = sys.argv[1]
mods = {}
for dp, _, fs in os.walk(root):
    for f in fs:
        if not f.endswith('.rs'): continue
        p = os.path.join(dp, f)
        rel = os.path.relpath(p, root)[:-3]
        parts = rel.split(os.sep)
        if parts[-1] in ('mod', 'lib', 'main'): parts = parts[:-1]
        mods['::'.join(parts)] = p
edges = {m: set() for m in mods}
for m, p in mods.items():
    src = open(p).read()
    src = re.sub(r'//[^\n]*', '', src)
    src = re.sub(r'#\[cfg\(test\)\]\s*mod tests\s*\{.*', '', src, flags=re.S)
    cur = m.split('::') if m else []
    refs = [(mt.group(1), mt.group(2).split('::')[1:]) for mt in re.finditer(r'\b(crate|super|self)((?:::\w+)+)', src)]
    for mt in re.finditer(r'\b((?:crate|super|self)(?:::\w+)*)::\{([^{}]*)\}', src):
        head = mt.group(1).split('::')
        for item in mt.group(2).split(','):
            item = item.strip().split(' as ')[0]
            if item: refs.append((head[0], head[1:] + item.split('::')))
    for kind, rest in refs:
        if kind == 'crate': base = []
        elif kind == 'super':
            base = cur[:-1]
            while rest and rest[0] == 'super': rest = rest[1:]; base = base[:-1]
        else: base = cur
        full = base + rest
        # longest prefix that is a module
        tgt = None
        for k in range(len(full), -1, -1):
            cand = '::'.join(full[:k])
            if cand in mods: tgt = cand; break
        if tgt is None or tgt == m: continue
        # a child importing its parent module's items, or parent its children: module tree, skip parent<->child
        if m.startswith(tgt + '::') if tgt else True: continue
        edges[m].add(tgt)
# Tarjan SCC
idx = {}; low = {}; st = []; on = set(); out = []; c = [0]
sys.setrecursionlimit(10000)
def sc(v):
    idx[v] = low[v] = c[0]; c[0] += 1; st.append(v); on.add(v)
    for w in edges[v]:
        if w not in idx: sc(w); low[v] = min(low[v], low[w])
        elif w in on: low[v] = min(low[v], idx[w])
    if low[v] == idx[v]:
        comp = []
        while True:
            w = st.pop(); on.discard(w); comp.append(w)
            if w == v: break
        if len(comp) > 1: out.append(sorted(comp))
for v in edges:
    if v not in idx: sc(v)
for comp in out:
    print("cycle:", comp)
    for a in comp:
        print("   ", a or "<root>", "->", sorted(x for x in edges[a] if x in comp))
print(len(out), "cycles over", len(mods), "modules of", root)
sys.exit(1 if out else 0)
