"""The device's copy bandwidth (bytes read + written per second of a 4 GiB
device-to-device copy, by torch): the denominator of a decode step's floor
(scripts/peer/decode_floor.py).

    python3 copy_bandwidth.py OUT.json
"""
import json
import sys
import time

import torch

n = 4 << 30
a = torch.empty(n, dtype=torch.uint8, device="cuda")
b = torch.empty_like(a)
for _ in range(3):
    b.copy_(a)
torch.cuda.synchronize()
reps, t = 20, time.perf_counter()
for _ in range(reps):
    b.copy_(a)
torch.cuda.synchronize()
s = time.perf_counter() - t
gbps = 2 * n * reps / s / 1e9
print(f"device copy: {gbps:.0f} GB/s (read + write)")
json.dump({"bytes": n, "reps": reps, "seconds": s, "gb_per_s": gbps}, open(sys.argv[1], "w"))
