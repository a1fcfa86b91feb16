"""The AVX2 fp32 linear kernel (kernels/linear_cpu.cpp) of the working tree against the same
kernel at another git revision, in one process: both are compiled into one program, each in
a namespace of its own, and they take turns in blocks of calls (the fastest block of each
kept), so that a stretch in which a shared machine runs slower lands on both alike; runs in
separate processes on such a machine differ by up to 2x from one minute to the next.

For each demo model (the target and the code draft, shapes from their config.json) and each
row count it prints the time of one forward's products (every layer's four weights and the
output layer), weights stored in bf16 (what the demo's bf16 checkpoints get; --fp32: in
fp32). A weight is multiplied by many times in a row, so it comes from L2 or L3 by its size
(in the engine a forward's weights, 11.5 MB for the demo target in bf16, come from L3).
Needs g++ and a CPU with AVX2 and FMA.

    python benchmarks/bench_linear_ab.py --against HEAD~1
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = "kernels/linear_cpu.cpp"
START, END = "#define BS_AVX2_FN", "// x [..., K] fp32 . the weight"

HARNESS = r"""
#include <immintrin.h>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <random>
#include <type_traits>
#include <vector>
#include "cpu_simd.h"   // BS_AVX2
constexpr int64_t N_BLOCK = 16;
namespace before {
#include "before.inc"
}
namespace after {
#include "after.inc"
}
using W = WEIGHT;
int main() {
  std::mt19937 g(0);
  std::normal_distribution<float> d;
  const int shapes[][3] = {SHAPES};   // out, in, how many a forward
  const int rows[] = {ROWS};
  for (int M : rows) {
    double total[2] = {0, 0};
    for (const auto& s : shapes) {
      const int64_t N = s[0], K = s[1], NB = (N + 15) / 16;
      std::vector<W> w0(NB * K * 16), w1(NB * K * 16);
      for (size_t i = 0; i < w0.size(); ++i) {
        if constexpr (std::is_same_v<W, float>) w0[i] = w1[i] = d(g);
        else w0[i] = w1[i] = uint16_t(g()) & 0x3fff;
      }
      std::vector<float> x(M * K), y(M * N);
      for (auto& v : x) v = d(g);
      const int reps = std::max(4, int(4e7 / (double(M) * N * K)));
      double best[2] = {1e9, 1e9};
      for (int block = 0; block < BLOCKS; ++block)
        for (int v = 0; v < 2; ++v) {
          const auto t0 = std::chrono::steady_clock::now();
          for (int r = 0; r < reps; ++r) {
            if (v == 0) before::f32_linear_blocks(x.data(), M, K, w0.data(), 0, NB, nullptr, y.data(), N);
            else after::f32_linear_blocks(x.data(), M, K, w1.data(), 0, NB, nullptr, y.data(), N);
          }
          const double dt = std::chrono::duration<double>(
              std::chrono::steady_clock::now() - t0).count() / reps;
          best[v] = std::min(best[v], dt);
        }
      total[0] += best[0] * s[2];
      total[1] += best[1] * s[2];
    }
    printf("%5d %12.1f %12.1f %8.2f\n", M, total[0] * 1e6, total[1] * 1e6, total[0] / total[1]);
    fflush(stdout);
  }
}
"""


def avx2_part(text: str, where: str) -> str:
    """The AVX2 templates of linear_cpu.cpp (the #define of their target up to linear_f32)."""
    if START not in text or END not in text:
        sys.exit(f"{where}: no AVX2 fp32 path between {START!r} and {END!r}")
    part = text[text.index(START):text.index(END)]
    return "\n".join(line for line in part.splitlines() if not line.startswith("#endif"))


def model_shapes(path: str) -> list[tuple[int, int, int]]:
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    h, i, L = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    d = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    return [(q + 2 * kv, h, L), (h, q, L), (2 * i, h, L), (h, i, L), (c["vocab_size"], h, 1)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", default="HEAD", help="git revision to compare with")
    ap.add_argument("--rows", default="1,2,3,4,5,8,10,16,20,32,40,64")
    ap.add_argument("--blocks", type=int, default=30)
    ap.add_argument("--fp32", action="store_true", help="weights stored in fp32")
    args = ap.parse_args()
    try:
        before = subprocess.run(["git", "show", f"{args.against}:{SOURCE}"], cwd=ROOT,
                                check=True, capture_output=True, text=True).stdout
    except FileNotFoundError:
        sys.exit("git not found: the revision to compare with is read from the repository")
    except subprocess.CalledProcessError as e:
        sys.exit(f"git show {args.against}:{SOURCE} failed: {e.stderr.strip()}")
    with open(os.path.join(ROOT, SOURCE)) as f:
        after = f.read()
    sys.path.insert(0, ROOT)
    from batchspec.demo import MODELS_DIR
    models = {name: model_shapes(os.path.join(MODELS_DIR, name)) for name in ("target", "draft-code")}
    with tempfile.TemporaryDirectory() as tmp:
        for name, text, where in (("before", before, args.against), ("after", after, "working tree")):
            with open(os.path.join(tmp, f"{name}.inc"), "w") as f:
                f.write(avx2_part(text, where))
        for model, shapes in models.items():
            src = HARNESS.replace("SHAPES", ", ".join(f"{{{n}, {k}, {c}}}" for n, k, c in shapes))
            src = src.replace("ROWS", args.rows).replace("BLOCKS", str(args.blocks))
            src = src.replace("WEIGHT", "float" if args.fp32 else "uint16_t")
            with open(os.path.join(tmp, "ab.cpp"), "w") as f:
                f.write(src)
            exe = os.path.join(tmp, "ab")
            try:
                subprocess.run(["g++", "-O3", "-fno-trapping-math", "-std=c++17",
                                f"-I{os.path.join(ROOT, 'kernels')}", "ab.cpp", "-o", exe],
                               cwd=tmp, check=True, capture_output=True, text=True)
            except FileNotFoundError:
                sys.exit("g++ not found: install a C++ compiler (Debian: apt install g++)")
            except subprocess.CalledProcessError as e:
                tail = "\n".join(e.stderr.strip().splitlines()[-5:])
                sys.exit(f"the AVX2 kernels did not compile on their own (the harness gives them "
                         f"cpu_simd.h and N_BLOCK):\n{tail}")
            label = re.sub(r"\s+", " ", args.against)[:12]
            print(f"{model}: one forward's products, {'fp32' if args.fp32 else 'bf16'} weights, us")
            print(f"{'rows':>5} {label:>12} {'this tree':>12} {'ratio':>8}", flush=True)
            rc = subprocess.run([exe]).returncode
            if rc == -signal.SIGILL:
                sys.exit("this CPU lacks AVX2 or FMA, which the kernels need")
            if rc not in (0, -signal.SIGPIPE):   # (SIGPIPE: the output's reader closed)
                sys.exit(f"the timing program failed (exit status {rc})")


if __name__ == "__main__":
    try:
        main()
    except BrokenPipeError:   # the output's reader closed (`| head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
