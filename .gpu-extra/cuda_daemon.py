# One-off check of the daemon on the CUDA backend: the memory budget's
# numbers and refusals, and LRU clocks that continue after a restart.
import os, subprocess, sys, time, tempfile
sys.path.insert(0, "python")
import numpy as np
import hkvd

root = tempfile.mkdtemp()
sock = os.path.join(root, "s.sock"); state = os.path.join(root, "state")
def start():
    p = subprocess.Popen([".gpu/bin/hkvd", "serve", "--backend", "cuda", "--socket", sock, "--state-dir", state, "--log", "info"],
                         stdout=subprocess.DEVNULL, stderr=open(os.path.join(os.environ["OUT"], "hkvd-cuda.log"), "a"))
    for _ in range(600):
        try:
            c = hkvd.Client(sock); c.ping(); return p, c
        except Exception:
            time.sleep(0.2)
    raise SystemExit("no daemon")
p, c = start()
m = c.stats()["memory"]; print("memory", m, "backend", c.stats()["backend"])
for cap, dim in [(1 << 40, 4), (1 << 62, 4)]:
    try:
        c.create_table(f"big{cap}", dim, cap); print("UNEXPECTED: created", cap)
    except hkvd.ResourceExhausted as e:
        print("refused as expected:", e)
# A table just past the budget: 8 bytes a value element plus 17 per slot.
slots = m["max_table_bytes"] // (17 + 4 * 256) + (1 << 24)
try:
    c.create_table("past", 256, slots); print("UNEXPECTED: created past-budget table")
except hkvd.ResourceExhausted as e:
    print("past budget refused:", e)
c.create_table("l", 8, 1 << 16)
keys = np.arange(1, 1001, dtype=np.uint64)
c.insert_or_assign("l", keys, np.ones((1000, 8), dtype=np.float32))
print("checkpoint", c.checkpoint(wait=True, full=True))
old = c.find("l", keys[:1], scores=True)
c.shutdown(); p.wait(timeout=120)
p, c = start()
time.sleep(0.5)
c.insert_or_assign("l", np.array([5000], dtype=np.uint64), np.ones((1, 8), dtype=np.float32))
r1 = c.find("l", keys[:1], scores=True); r2 = c.find("l", np.array([5000], dtype=np.uint64), scores=True)
print("restored key score", r1, "new key score", r2)
s_old = int(np.asarray(r1[-1]).ravel()[0]); s_new = int(np.asarray(r2[-1]).ravel()[0])
print("LRU clock continues:", s_new > s_old, s_old, s_new)
print("stats tables", [(t["spec"]["name"], t["size"]) for t in c.stats()["tables"]])
c.shutdown(); p.wait(timeout=120)
