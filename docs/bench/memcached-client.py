# The client of docs/bench/memcached-same-sequence.out: loads 134,217 values of 4000 bytes, then
# sends zipf 0.99 get/set (90/10) from a fixed seed: python3 memcached-client.py PORT SECONDS MAX_REQUESTS
import socket, random, sys, time, bisect
N = 512*1024*1024//4000
port = int(sys.argv[1]); secs = float(sys.argv[2])
s = socket.create_connection(("127.0.0.1", port))
f = s.makefile("rb")
# load
for k0 in range(0, N, 32):
    buf = b"".join(b"set key:%012d 0 0 4000 noreply\r\n" % k + (b"%08d" % k)*500 + b"\r\n" for k in range(k0, min(N, k0+32)))
    s.sendall(buf)
s.sendall(b"version\r\n"); f.readline()
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
        s.sendall(b"get key:%012d\r\n" % k)
        line = f.readline()
        assert line.startswith(b"VALUE"), line
        data = f.read(4002); end = f.readline()
        assert data[:8] == b"%08d" % k
    else:
        s.sendall(b"set key:%012d 0 0 4000\r\n" % k + (b"%08d" % k)*500 + b"\r\n"); f.readline()
    ops+=1
print("requests", ops, "in %.1f s" % (time.time() - t0), flush=True)
