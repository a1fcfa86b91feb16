// Host code built for several instruction sets where the compiler can (GCC on x86-64), the
// best one chosen when the library loads: one build runs on any x86-64 machine.
#pragma once
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define BS_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define BS_CLONES
#endif
