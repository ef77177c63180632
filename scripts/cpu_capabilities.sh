#!/bin/sh
# The ATEN_CPU_CAPABILITY values worth a second run of the `numerics` tests on this CPU: every vector
# instruction set PyTorch's CPU kernels dispatch on (x86: default, avx2, avx512) except the best one,
# which the plain test run already uses. PyTorch takes avx512 when the CPU has avx512f, bw, vl and dq,
# avx2 when it has avx2 (and fma). Prints nothing extra on other CPUs: `default` only.
flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
has() { case "$flags" in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
caps="default"
if has avx512f && has avx512bw && has avx512vl && has avx512dq && has avx2; then
  caps="$caps avx2"  # the plain run is avx512
fi
echo "$caps"
