# Mixed load for daemon/bench/rss.sh: N connections for S seconds sending
# finds and inserts of 1 to 65536 keys, echoes of up to 3 MiB and short
# malformed frames. Usage: mixed_load.py SOCKET SECONDS CONNECTIONS
import socket, struct, random, threading, sys, time, json
sock_path = sys.argv[1]; seconds = float(sys.argv[2]); nconn = int(sys.argv[3])
def frame(op, flags, rid, body): return b"HKVD" + struct.pack("<BBHQI", 1, op, flags, rid, len(body)) + body
def s_(t): b=t.encode(); return struct.pack("<H", len(b)) + b
def recv_exact(s, n):
    buf = bytearray()
    while len(buf) < n:
        c = s.recv(n - len(buf))
        if not c: raise EOFError
        buf += c
    return bytes(buf)
def call(s, f):
    s.sendall(f); h = recv_exact(s, 20); n = struct.unpack("<I", h[16:20])[0]; return h, recv_exact(s, n)
def worker(seed):
    r = random.Random(seed); s = socket.socket(socket.AF_UNIX); s.connect(sock_path)
    t0 = time.time(); i = 0
    while time.time() - t0 < seconds:
        i += 1
        n = r.choice([1, 7, 100, 1000, 4096, 20000, 65536])
        dim = 16
        keys = struct.pack("<I", n) + b"".join(struct.pack("<Q", r.randrange(1, 1 << 22)) for _ in range(min(n, 1))) * n
        k = r.random()
        try:
            if k < 0.4:
                call(s, frame(0x10, 0, i, s_("t") + keys))
            elif k < 0.7:
                vals = struct.pack("<I", n * dim) + bytes(4 * n * dim)
                call(s, frame(0x12, 0, i, s_("t") + keys + vals))
            elif k < 0.8:
                call(s, frame(0x02, 0, i, struct.pack("<I", r.choice([10, 1000, 1 << 20, 3 << 20]))))
            else:
                body = bytes(r.randrange(0, 256) for _ in range(r.randrange(0, 64)))
                call(s, frame(r.choice([0x10, 0x12, 0x20, 0x1e, 0x30]), 0, i, body))
        except (EOFError, ConnectionError):
            s = socket.socket(socket.AF_UNIX); s.connect(sock_path)
ts = [threading.Thread(target=worker, args=(j,)) for j in range(nconn)]
[t.start() for t in ts]; [t.join() for t in ts]
