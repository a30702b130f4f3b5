#!/usr/bin/env python3
"""How far the fp8 attention decode's stepped rotation drifts from cos/sin
(kernels/attention.cu, `decode`): each thread turns (cos, sin) of a
frequency band by S = 8 positions an item with f32 FMAs, reading the RoPE
table again at least every RELOAD_TILES = 16 tiles of 8 items, so at most
128 steps run between reads. f32 arithmetic is emulated (one rounding per
operation, FMAs rounded once); the reference is cos/sin in f64.

    rotation_drift.py [THETA]   (default 500000, Llama 3's; 10000 is SmolLM2's)
"""
import math
import struct
import sys


def f32(x):
    return struct.unpack("f", struct.pack("f", x))[0]


def fma(a, b, c):
    # a·b is exact in f64 for f32 a and b; one rounding of the sum.
    return f32(a * b + c)


def main(theta):
    half, step, steps = 64, 8, 128
    worst = 0.0
    for i in range(half):
        w = f32(1.0 / theta ** (2 * i / (2 * half)))
        wc, ws = f32(math.cos(step * w)), f32(math.sin(step * w))
        for p0 in (0, 1_000, 8_000, 30_000, 120_000):
            c, s = f32(math.cos(p0 * w)), f32(math.sin(p0 * w))
            for n in range(1, steps + 1):
                c, s = fma(c, wc, -f32(s * ws)), fma(s, wc, f32(c * ws))
                p = p0 + step * n
                worst = max(worst, abs(c - math.cos(p * w)), abs(s - math.sin(p * w)))
    print(f"theta {theta:g}: worst |error| of cos/sin over {steps} steps of {step} positions: {worst:.2e}")


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 500_000.0)
