# The client of docs/bench/memcached-same-sequence.out and redis-same-sequence.out: loads
# 134,217 values of 4000 bytes, then sends zipf 0.99 gets and sets (90/10) from a fixed seed,
# the same requests on every run: python3 kv-client.py memcached|redis PORT SECONDS MAX_REQUESTS
import bisect, random, socket, sys, time

server, port, secs, most = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
N = 512 * 1024 * 1024 // 4000
s = socket.create_connection(("127.0.0.1", port))
f = s.makefile("rb")


def value(k):
    return (b"%08d" % k) * 500


def set_cmd(k, reply):
    if server == "memcached":
        head = b"set key:%012d 0 0 4000%s\r\n" % (k, b"" if reply else b" noreply")
    else:
        head = b"SET key:%012d " % k
    return head + value(k) + b"\r\n"


# Load, 32 sets per write.
for k0 in range(0, N, 32):
    s.sendall(b"".join(set_cmd(k, False) for k in range(k0, min(N, k0 + 32))))
if server == "memcached":
    s.sendall(b"version\r\n")
    f.readline()
else:
    for _ in range(N):
        f.readline()
print("loaded", N, flush=True)

# Zipf 0.99 over the keys, popular keys scattered over the key space.
w = [1.0 / (i + 1) ** 0.99 for i in range(N)]
tot = sum(w)
acc, cdf = 0.0, []
for x in w:
    acc += x
    cdf.append(acc / tot)
stride = 7919 * 13
t0, ops = time.time(), 0
rng = random.Random(1)
while time.time() - t0 < secs and ops < most:
    k = (bisect.bisect_left(cdf, rng.random()) * stride) % N
    if rng.random() < 0.9:
        if server == "memcached":
            s.sendall(b"get key:%012d\r\n" % k)
            assert f.readline().startswith(b"VALUE")
            data = f.read(4002)
            f.readline()
        else:
            s.sendall(b"GET key:%012d\r\n" % k)
            assert f.readline().startswith(b"$4000")
            data = f.read(4002)
        assert data[:8] == b"%08d" % k
    else:
        s.sendall(set_cmd(k, True))
        f.readline()
    ops += 1
print("requests", ops, "in %.1f s" % (time.time() - t0), flush=True)
