# Random single-byte writes over a bytearray of N MiB for S seconds (docs/bench, BENCHMARKS.md
# fourteenth run): python3 random-writes.py N S
import random, time, sys
n = int(sys.argv[1]) << 20
secs = float(sys.argv[2])
b = bytearray(n)
pages = n // 4096
r = random.Random(1)
t0 = time.time(); k = 0
while time.time() - t0 < secs:
    for _ in range(10000):
        p = r.randrange(pages) * 4096
        b[p] = (b[p] + 1) & 255
    k += 10000
print(k, sum(b[::4096]) % 1000)
