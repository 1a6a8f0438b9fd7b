"""The ring on CUDA: its reducer's streams and events, its device-timed ``comm/seconds``, and with
two GPUs the ring, the hierarchical ring and the peer watch's NCCL abort. Written for a GPU; not
run in this project's sessions so far (no GPU was lent). ``test_strategies_gpu.py`` holds the
``ring`` / ``ring_bf16`` fits at world 1 against the CPU.

- World 1 (any GPU): the reducer's stream waits for the event recorded where the bucket was written
  (late, behind ``torch.cuda._sleep``), its futures are CUDA-aware (a consumer on another stream
  reads the reduced values), nothing in submit / wait syncs the host, and every call is timed by
  an event pair read without waiting. A fit logs ``comm/seconds`` from those events.
- Two ranks need two GPUs: NCCL refuses two ranks on one device, and gloo's send/recv, which the
  ring uses, cannot take CUDA tensors. There, ``ring_all_reduce`` (fp32, bf16 wire) and
  ``hierarchical_all_reduce`` (2 "nodes" of 1) equal ``dist.all_reduce`` on the GPU, and a frozen
  peer (heartbeat stopped, never entering the collective) ends the survivor's NCCL all-reduce
  with ``PeerLostError`` through the watch's ``abort()``, well before the group's timeout.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from _ring_gpu_ranks import PG_TIMEOUT_S, frozen_peer, nccl_ring
from gpu_utils import no_host_sync
from lightning_utils import TinyRegressor, regression_data
from torch.utils.data import DataLoader

from benchmarks._workers import run_workers
from lightning_strategies.comm.ring import RingBucketReducer
from lightning_strategies.strategies.ring import RingAllReduceStrategy

pytestmark = pytest.mark.gpu
CPU_DRY_RUN = False  # events, streams and NCCL: nothing here means anything on the CPU

SLEEP_CYCLES = 5_000_000  # a few ms of GPU time: a bucket written behind it is written late
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL: one rank per device)")


def test_reducer_waits_for_the_bucket_stream_and_never_syncs_the_host(cuda: torch.device) -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        reducer = RingBucketReducer(dist.new_group())
        producer, consumer = torch.cuda.Stream(cuda), torch.cuda.Stream(cuda)
        staged = [torch.full((1 << 20,), float(i), device=cuda) for i in range(4)]
        torch.cuda.synchronize()
        with no_host_sync():
            futures, buckets = [], []
            with torch.cuda.stream(producer):
                for src in staged:
                    torch.cuda._sleep(SLEEP_CYCLES)
                    bucket = src.mul(2.0)  # written late on the producer's stream
                    buckets.append(bucket)
                    futures.append(reducer.submit(bucket))
            with torch.cuda.stream(consumer):
                # wait() makes the consumer's stream wait for the reducer's; it does not block the host
                sums = [f.wait().sum() for f in futures]
        torch.cuda.synchronize()
        # world 1: the reduction is the identity; a read before the producer's late write would see
        # whatever the allocator's memory held
        assert [float(s) for s in sums] == [2.0 * i * (1 << 20) for i in range(4)]
        seconds, calls = reducer.pop_device_seconds()
        assert calls == 4 and seconds >= 0.0
        assert reducer.pop_stats().seconds == 0.0  # CUDA: host time is not the ring's time
        reducer.close()
    finally:
        dist.destroy_process_group()


def test_fit_logs_device_timed_comm_seconds(cuda: torch.device) -> None:
    trainer = pl.Trainer(
        accelerator="cuda", devices=1, strategy=RingAllReduceStrategy(), max_steps=6, log_every_n_steps=2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(TinyRegressor(), DataLoader(regression_data(), batch_size=8))
    metrics = trainer.callback_metrics
    assert float(metrics["comm/calls"]) == 1.0
    assert 0.0 <= float(metrics["comm/seconds"]) < 1.0  # from the events of calls the device finished


@TWO_GPUS
def test_ring_and_hierarchical_ring_equal_nccl_all_reduce_on_two_gpus() -> None:
    for rank_found in run_workers(nccl_ring, 2, timeout=300, start_method="spawn"):
        for case, (flat, hier) in rank_found.items():
            # fp32: two values summed in either order are the same; bf16 wire: rounded to bf16 (2^-9) twice
            tol = 0.0 if "None" in case else 2 * 2**-9
            assert flat <= tol and hier <= tol, (case, flat, hier)


@TWO_GPUS
def test_a_frozen_peer_ends_an_nccl_all_reduce_through_the_watch() -> None:
    found = run_workers(frozen_peer, 2, timeout=300, start_method="spawn")
    result = found[0]
    assert result["error"] is not None and "ddp: lost peer rank 1 of 2:" in result["error"], result
    assert result["ranks"] == [1], result
    assert result["seconds"] < PG_TIMEOUT_S / 2, result  # the watch's abort, not the watchdog's timeout
