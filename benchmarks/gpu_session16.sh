#!/usr/bin/env bash
# Session 16's kernel and speculative call (device tool, carry [".whl"]), parts in order, each
# time-limited; one tar comes back ($OUT/s16.tar).
#   hot_resolve   benchmarks/hot_resolve_gpu.py: xla, triton_copy, triton_fused (4 launches)
#                 and triton_fused2 (2 launches) at B 64, k 512, 5% / 0% misses, hot rows
#                 donated, each checked equal to xla, with per-kernel busy time from a profile
#                 (issue 16: <= 0.10 / 0.03 ms), then the hot_resolve GPU tests (fused2 included)
#   spec_v4       configs/experiments/speculative_v4.gin: the cost side of speculative decoding
#                 at V4 shapes, hisparse and leansparse at C8, untrained drafter (issue 15)
#   capped        configs/experiments/serve_capped.gin: hisparse and adaptive, each plain and
#                 with the trained drafter, under one budget of 8 plain hisparse requests
#                 (issue 15: adaptive + drafter >= 1.7x hisparse where memory caps admission)
#   topk          benchmarks/topk_launch_gpu.py --sweep: triton_fused's select / finish warps,
#                 chunk and block at 64 x 262144, k 2048 (issue 16: <= 0.050 ms), per kernel
#   prefix_admit  (only when named in PARTS) benchmarks/prefix_admit.py at V4 shapes (128K
#                 prefix + 2K suffix): where LeanSparse's continuation admission spends its time
# PARTS="..." runs a subset (names above; default: hot_resolve capped spec_v4 topk). The
# default's limits add up to 560 s: the call fits the device tool's 600 s.
source "$(dirname "$0")/gpu_lib.sh"
PARTS=${PARTS:-hot_resolve capped spec_v4 topk}
part hot_resolve 100 "python3 benchmarks/hot_resolve_gpu.py --out \$OUT && \
  python3 -m pytest -q -m gpu tests/test_kernel_hot_resolve.py -p no:cacheprovider"
TAIL=16 part capped 150 "bash benchmarks/serve_capped_cells.sh"
TAIL=12 part spec_v4 220 "python3 -m experiments.cli run configs/experiments/speculative_v4.gin"
TAIL=14 part topk 90 "python3 benchmarks/topk_launch_gpu.py --out \$OUT --budget-s 75 \
  --sweep sw4,fw4,fw16,c1024,c2048,b8192c2048,b4096c1024sw4,sw16"
part prefix_admit 180 "python3 benchmarks/prefix_admit.py --preset v4_flash --prefix 131072 \
  --suffix 2048 --chunk 4096 --page 64 --implementation triton --repeats 2 --out \$OUT"
pack s16
