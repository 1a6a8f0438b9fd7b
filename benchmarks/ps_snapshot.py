"""What a reply's snapshot costs a parameter-server shard per step, against handing out the live
parameters, next to the optimizer step it follows.

A shard answers with a copy of its values (``pack``: one flat tensor per dtype), made on the
shard's stream, so that no later step changes a reply still being read or sent (on a GPU the
next push's step may run while TensorPipe still reads the previous reply). Handing out the live
tensors would save that copy and be wrong under ``async`` and on CUDA streams. This measures, on
the shard's share of ResNet-50 (25.6M parameters over 2 shards; ``--quick``: 1M elements), the
snapshot's time and the SGD-with-momentum step's, interleaved, medians of ``--reps``:

    snapshot_ms_N*        the copy of the shard's values into one payload (fresh memory, as a reply)
    reused_ms_N*          the same copy into a buffer written before: on CPU most of a fresh
                          snapshot's time is the first touch of new pages (the CUDA caching
                          allocator hands a freed block back instead)
    live_ms_N*            returning the live tensors (no copy)
    step_ms_N*            the shard's optimizer step (SGD, momentum 0.9)
    snapshot_over_step_N* the copy's cost as a share of the step's
    snapshot_bytes_N*     bytes copied per snapshot: 4 N (one per step under "ps", whatever the
                          worker count; one per pull under "async")

Run: ``python benchmarks/ps_snapshot.py`` (``--device cuda`` on a GPU: times include a synchronize).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import header, line, load_line, median
from lightning_strategies.comm.ps import pack

RESNET50_PARAMS = 25_557_032


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


def measure(n: int, reps: int, device: torch.device) -> None:
    # a shard's slices: one big tensor and a few small ones, as a cut of a model's flat parameters
    sizes = [n - 3 * 1024, 1024, 1024, 1024]
    params = [torch.randn(s, device=device).requires_grad_(True) for s in sizes]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.SGD(params, lr=0.01, momentum=0.9)
    opt.step()  # momentum buffers exist: every timed step does the same work
    snap: list[float] = []
    reused: list[float] = []
    live: list[float] = []
    step: list[float] = []
    buffer = torch.empty(n, device=device)
    flat = [p.detach().reshape(-1) for p in params]
    for _ in range(reps):  # interleaved: the load affects all four alike
        step.append(_timed(opt.step, device))
        snap.append(_timed(lambda: pack(params), device))
        reused.append(_timed(lambda: torch.cat(flat, out=buffer), device))
        live.append(_timed(lambda: list(params), device))
    tag = f"N{n}"
    line(f"snapshot_ms_{tag}", median(snap), "ms")
    line(f"reused_ms_{tag}", median(reused), "ms")
    line(f"live_ms_{tag}", max(median(live), 1e-6), "ms")
    line(f"step_ms_{tag}", median(step), "ms")
    line(f"snapshot_over_step_{tag}", median(snap) / median(step), "x")
    line(f"snapshot_bytes_{tag}", float(pack(params).nbytes), "bytes")
    line(f"snapshot_bytes_over_4N_{tag}", pack(params).nbytes / (4 * n), "x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1M elements, 5 repetitions")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    print(header("ps_snapshot"), flush=True)
    print(load_line("start"), flush=True)
    n = 1 << 20 if args.quick else RESNET50_PARAMS // 2
    measure(n, 5 if args.quick else args.reps, device)
    print(load_line("end"), flush=True)


if __name__ == "__main__":
    main()
