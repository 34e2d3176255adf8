# The client of docs/bench/redis-same-sequence.out: loads 134,217 values of 4000 bytes, then
# sends zipf 0.99 GET/SET (90/10) from a fixed seed: python3 redis-client.py PORT SECONDS MAX_REQUESTS
import socket, random, sys, time, bisect
N = 512*1024*1024//4000
port = int(sys.argv[1]); secs = float(sys.argv[2])
s = socket.create_connection(("127.0.0.1", port))
f = s.makefile("rb")
# load
for k0 in range(0, N, 32):
    buf = b"".join(b"SET key:%012d " % k + (b"%08d" % k)*500 + b"\r\n" for k in range(k0, min(N, k0+32)))
    s.sendall(buf)
[f.readline() for _ in range(N)]
print("loaded", N, flush=True)
# zipf 0.99 cdf
w = [1.0/(i+1)**0.99 for i in range(N)]
tot = sum(w); acc=0; cdf=[]
for x in w: acc+=x; cdf.append(acc/tot)
stride = 7919*13
t0=time.time(); ops=0
rng = random.Random(1)
while time.time()-t0 < secs and ops < int(sys.argv[3]):
    r = bisect.bisect_left(cdf, rng.random())
    k = (r*stride) % N
    if rng.random() < 0.9:
        s.sendall(b"GET key:%012d\r\n" % k)
        line = f.readline()
        assert line.startswith(b"$4000"), line
        data = f.read(4002)
        assert data[:8] == b"%08d" % k
    else:
        s.sendall(b"SET key:%012d " % k + (b"%08d" % k)*500 + b"\r\n"); f.readline()
    ops+=1
print("requests", ops, "in %.1f s" % (time.time() - t0), flush=True)
