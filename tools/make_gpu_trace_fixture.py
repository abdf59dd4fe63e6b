"""Write tests/fixtures/gpu_traces/synthetic_2rank/trace/rank<R>.json: two ranks' torch profiler traces in its GPU
format, small enough to read by hand, for `gptpar trace` and Holistic Trace Analysis (HTA) to agree or disagree on.

Until a real GPU trace is kept beside it (each folder under tests/fixtures/gpu_traces/ is a run folder with its
trace/), this is the GPU test of `gptpar trace`; tests/report/test_trace_hta.py holds the answers worked out by hand
from the kernels below. What HTA's parser reads, and so what each trace carries: `distributedInfo` (rank, world
size), `deviceProperties`, two `ProfilerStep#<n>` spans (HTA keeps the kernels launched inside the steps), a
`cuda_runtime` launch per GPU event whose `correlation` its kernel shares, and kernels with `device` and `stream`.

Re-make it with `python tools/make_gpu_trace_fixture.py` (from the repository root).
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "gpu_traces" / "synthetic_2rank" / "trace"
T0 = 1_000_000.0  # microseconds since the profiler's clock began; every time below is relative to it
PID = 4242  # the rank's process on the host; the GPU's events are on pid 0 (the device), tid = the stream
COMPUTE, NCCL = 7, 13  # the CUDA streams
ALL_REDUCE = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
GEMM = "sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x32_warpgroupsize1x1x1_execute_segment_k_off_kernel"
ELEMENTWISE = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>(int, float*)"

# Per rank: (name, category, stream, start, end) of each GPU event, microseconds after T0. Both ranks profile steps
# 2 and 3, [0, 100) and [100, 200).
# rank 0: a device-to-host copy [160, 170) that gptpar counts as idle (it reads kernels) and HTA as non-compute,
# and a GPU busy only from 10 to 190: HTA's window, 180 us, against gptpar's 200.
# rank 1: kernels from 2 to 199, no copy: the two agree within a couple of points; one all-reduce starts at 149.5,
# which HTA rounds up to 150 (it rounds every event inward to whole microseconds), so the overlaps differ a little.
KERNELS = {
    0: [(GEMM, "kernel", COMPUTE, 10, 50), (ALL_REDUCE, "kernel", NCCL, 30, 70),
        (ELEMENTWISE, "kernel", COMPUTE, 55, 80), (GEMM, "kernel", COMPUTE, 110, 150),
        (ALL_REDUCE, "kernel", NCCL, 140, 160), ("Memcpy DtoH (Device -> Pinned)", "gpu_memcpy", COMPUTE, 160, 170),
        (ELEMENTWISE, "kernel", COMPUTE, 170, 190)],
    1: [(GEMM, "kernel", COMPUTE, 2, 60), (ALL_REDUCE, "kernel", NCCL, 40, 90),
        (ELEMENTWISE, "kernel", COMPUTE, 90, 98), (GEMM, "kernel", COMPUTE, 102, 170),
        (ALL_REDUCE, "kernel", NCCL, 149.5, 180), (ELEMENTWISE, "kernel", COMPUTE, 185, 199)],
}
STEPS = {2: (0, 100), 3: (100, 200)}
DEVICE = {"id": 0, "name": "NVIDIA H200", "totalGlobalMem": 150754820096, "computeMajor": 9, "computeMinor": 0,
          "maxThreadsPerBlock": 1024, "maxThreadsPerMultiprocessor": 2048, "regsPerBlock": 65536,
          "regsPerMultiprocessor": 65536, "warpSize": 32, "sharedMemPerBlock": 49152,
          "sharedMemPerMultiprocessor": 233472, "numSms": 132, "sharedMemPerBlockOptin": 232448}


def event(name: str, cat: str, start: float, end: float, pid: int, tid: int, **args: object) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": T0 + start, "dur": float(end - start),
            "args": args}


def trace(rank: int) -> dict:
    events: list[dict] = [{"ph": "M", "name": "process_name", "pid": PID, "tid": 0, "args": {"name": "python"}},
                          {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "GPU 0"}}]
    external = 0
    for step, (start, end) in STEPS.items():
        external += 1
        events.append(event(f"ProfilerStep#{step}", "user_annotation", start, end, PID, PID,
                            **{"External id": external}))
    for correlation, (name, cat, stream, start, end) in enumerate(KERNELS[rank], start=100):
        external += 1
        launch = max(start - 2, next(s for s, e in STEPS.values() if s <= start < e))  # in the kernel's step, before it
        api = "cudaMemcpyAsync" if cat == "gpu_memcpy" else "cudaLaunchKernel"
        events.append(event(api, "cuda_runtime", launch, launch + 1, PID, PID, cbid=211, correlation=correlation,
                            **{"External id": external}))
        events.append(event(name, cat, start, end, 0, stream, device=0, context=1, stream=stream,
                            correlation=correlation, queued=0, **{"External id": external}))
        events += [{"ph": "s", "id": correlation, "pid": PID, "tid": PID, "ts": T0 + launch, "cat": "ac2g",
                    "name": "ac2g"},
                   {"ph": "f", "id": correlation, "pid": 0, "tid": stream, "ts": T0 + start, "cat": "ac2g",
                    "name": "ac2g", "bp": "e"}]
    return {"schemaVersion": 1, "deviceProperties": [DEVICE],
            "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": len(KERNELS), "pg_count": 1,
                                "nccl_version": "2.27.5"},
            "cuda_runtime_version": 13000, "cuda_driver_version": 13000, "displayTimeUnit": "ms",
            "baseTimeNanoseconds": 1764300000000000000, "traceEvents": events, "traceName": f"rank{rank}.json"}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for rank in KERNELS:
        (OUT / f"rank{rank}.json").write_text(json.dumps(trace(rank), indent=1) + "\n")
        print(f"wrote {OUT / f'rank{rank}.json'}")


if __name__ == "__main__":
    main()
