"""What one core of this CPU can do, to read the kernels' rates against: fp32 multiply-adds
per second on AVX2 (12 independent 8-lane FMA chains, enough to hide the FMA's latency on
any AVX2 core) and read bandwidth over buffers of several sizes (sums of 256-bit loads;
the small ones come from cache, the large ones from memory). Compiled with g++ for this
CPU at run time; one thread; the fastest of 5 runs each.

A kernel near the FMA peak is bound by arithmetic: speculation then saves only what a
decode step spends beyond its products (the demo target's 5-token windows at 32 rows cost
about 5x a decode step's products on such a CPU). One near the memory figure is bound by
reading its weights or KV cache, which a verification window reads once for all its tokens.

    python benchmarks/cpu_peak.py [--sizes-mb 1,4,64]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

SOURCE = r"""
#include <immintrin.h>
#include <cstdio>
#include <cstdlib>
#include <ctime>

static double now() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char** argv) {
  // FMA throughput: 12 chains of a = a * x + y, 8 lanes each
  const long n = 20000000;
  double best = 1e30;
  float keep = 0.f;
  for (int run = 0; run < 5; ++run) {
    __m256 a[12];
    for (int i = 0; i < 12; ++i) a[i] = _mm256_set1_ps(0.001f * i);
    const __m256 x = _mm256_set1_ps(0.9999f), y = _mm256_set1_ps(1e-5f);
    const double t0 = now();
    for (long it = 0; it < n; ++it)
      for (int i = 0; i < 12; ++i) a[i] = _mm256_fmadd_ps(a[i], x, y);
    const double t = now() - t0;
    if (t < best) best = t;
    for (int i = 0; i < 12; ++i) keep += a[i][0];
  }
  std::printf("fma %.3f\n", n * 12.0 * 8 / best / 1e9);
  // read bandwidth for each size given (MB)
  for (int s = 1; s < argc; ++s) {
    const size_t mb = std::strtoul(argv[s], nullptr, 10);
    const size_t len = (mb << 20) / sizeof(float);
    float* buf = static_cast<float*>(std::aligned_alloc(64, len * sizeof(float)));
    for (size_t i = 0; i < len; ++i) buf[i] = 1.f;
    const int passes = int(512 / mb) + 1;
    double fastest = 1e30;
    for (int run = 0; run < 5; ++run) {
      __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
      const double t0 = now();
      for (int p = 0; p < passes; ++p)
        for (size_t i = 0; i < len; i += 32) {
          s0 = _mm256_add_ps(s0, _mm256_load_ps(buf + i));
          s1 = _mm256_add_ps(s1, _mm256_load_ps(buf + i + 8));
          s2 = _mm256_add_ps(s2, _mm256_load_ps(buf + i + 16));
          s3 = _mm256_add_ps(s3, _mm256_load_ps(buf + i + 24));
        }
      const double t = now() - t0;
      if (t < fastest) fastest = t;
      keep += _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3))[0];
    }
    std::printf("read %zu %.3f\n", mb, passes * double(len * sizeof(float)) / fastest / 1e9);
    std::free(buf);
  }
  std::fprintf(stderr, "(%g)\n", keep);   // keeps the sums live
  return 0;
}
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", default="1,4,64",
                    help="buffer sizes for the read bandwidth, MB, comma-separated")
    args = ap.parse_args()
    try:
        sizes = [int(s) for s in args.sizes_mb.split(",") if s]
    except ValueError:
        ap.error(f"--sizes-mb takes whole MB, comma-separated (got {args.sizes_mb!r})")
    if any(s < 1 for s in sizes):
        ap.error("--sizes-mb: each size 1 MB or more")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = os.path.join(tmp, "peak.cpp"), os.path.join(tmp, "peak")
        with open(src, "w") as f:
            f.write(SOURCE)
        try:
            subprocess.run(["g++", "-O3", "-mavx2", "-mfma", src, "-o", exe], check=True,
                           capture_output=True, text=True)
        except FileNotFoundError:
            sys.exit("cpu_peak: needs g++ (apt-get install g++)")
        except subprocess.CalledProcessError as e:
            sys.exit(f"cpu_peak: the probe did not compile: {e.stderr.strip()}")
        try:
            out = subprocess.run([exe, *map(str, sizes)], check=True, capture_output=True,
                                 text=True).stdout
        except subprocess.CalledProcessError:
            sys.exit("cpu_peak: the probe failed: this CPU needs AVX2 and FMA")
    print("one core, fastest of 5 runs")
    for line in out.splitlines():
        kind, *vals = line.split()
        if kind == "fma":
            print(f"fp32 FMA (AVX2):          {float(vals[0]):7.2f} GMAC/s")
        else:
            print(f"read, {int(vals[0]):>4} MB buffer:     {float(vals[1]):7.2f} GB/s")


if __name__ == "__main__":
    main()
