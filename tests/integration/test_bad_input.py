"""Bad input, tried systematically: one table, each row a clear error or a documented outcome.

Every row gives the library or the app one bad thing (a strategy name, a world size, a
checkpoint file, a loss, an image, a dataset, a batch size) and states what must happen:

- a clear **error**: the exception type, and fragments of its message saying what was found,
  what was expected and what to change; in a multi-process row *every* rank must end with that
  error (none may hang in a collective waiting for a peer that stopped);
- a documented **skip**, counted (an unreadable image: skipped, named in a warning, counted);
- a supported **load** (a checkpoint of another strategy: the formats are the same), checked
  against the math: resuming in strategy B from strategy A's checkpoint ends with the weights
  of an uninterrupted single-device run.

Unit-speed rows run in this process; multi-process rows (2 ranks forked from this process,
each a Lightning job launched "by hand": ``LOCAL_RANK``/``WORLD_SIZE``/``MASTER_PORT`` set, so
no launcher kills a survivor for us) and subprocess rows are marked ``slow``. The table's
``found`` and ``outcome`` columns are the "Bad input" table of docs/reliability.md. The rows'
actions and checks, the ranks launched by hand and the fits they run are in ``_bad_input_actions.py``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _bad_input_actions import (
    Ended,
    app_rows,
    batch_smaller_than_microbatches,
    corrupt_checkpoint_app,
    corrupt_checkpoint_ring,
    corrupt_checkpoint_single,
    cross_load,
    empty_loader_library,
    equals_uninterrupted_single_run,
    global_batch_below_replicas_app,
    interrupted_save,
    last_checkpoint_is_step_2_and_finite,
    lightning_warns_and_takes_no_step,
    more_stages_than_blocks,
    mostly_unreadable_images,
    non_finite,
    non_finite_single_keeps_last_checkpoint,
    other_model_app,
    other_model_library,
    other_model_recipe,
    per_device_batch_zero_library,
    previous_last_checkpoint_resumes,
    skipped_and_counted,
    stages_not_dividing_world,
    stages_not_dividing_world_app,
    unknown_strategy_app,
    unknown_strategy_trainer,
    unreadable_image_fit,
    unreadable_image_loader,
    unreadable_image_strict,
)
from app_utils import FEW_BATCHES

# -- the table -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One bad input and what must happen.

    Attributes:
        id: the test id.
        found: the bad input, in words (docs/reliability.md's left column).
        outcome: what happens, in words (docs/reliability.md's right column).
        act: does it; returns how each rank (or the one process) ended.
        error: the exception type name every rank must end with; None: none may raise.
        fragments: regular expressions the message must contain (found, expected, fix).
        check: further assertions on a row that ends without an error.
        slow: multi-process or subprocess (marked ``slow``).
        races: for rows whose ranks race (async: a rank may hear of its peer's error before it
            pulls the broken weights itself), the fragments a rank's message must contain when
            it ends with another error than ``error``; None: every rank must end with ``error``.
    """

    id: str
    found: str
    outcome: str
    act: Callable[[Path], list[Ended]]
    error: str | None
    fragments: tuple[str, ...] = ()
    check: Callable[[list[Ended], Path], None] | None = None
    slow: bool = False
    races: tuple[str, ...] | None = None


FIX = r"Fix: "
ROWS: list[Row] = [
    Row(
        "unknown-strategy-trainer",
        'Trainer(strategy="rnig")',
        "Lightning's ValueError naming the invalid name",
        unknown_strategy_trainer,
        "ValueError",
        (r"invalid strategy name: `strategy='rnig'`",),
    ),
    Row(
        "unknown-strategy-app",
        "python train.py strategy=rnig",
        "exits non-zero before training; Hydra lists the strategy options",
        unknown_strategy_app,
        "exit 1",
        (r"Could not find 'strategy/rnig'", r"Available options", r"\bring\b", r"\bps\b", r"\bpipeline\b"),
        slow=True,
    ),
    Row(
        "stages-not-dividing-world",
        "PipelineStrategy(num_stages=2) on 3 processes",
        "ValueError when the Trainer is built, before any process starts",
        stages_not_dividing_world,
        "ValueError",
        (r"world size of 3 processes", r"3 is not a multiple of 2", FIX + r"pass num_stages dividing 3 \(e.g. 1, 3\)"),
    ),
    Row(
        "stages-not-dividing-world-app",
        "strategy=pipeline strategy.num_stages=3 trainer=ddp_sim (2 processes)",
        "the same ValueError, before any process starts",
        stages_not_dividing_world_app,
        "ValueError",
        (r"2 is not a multiple of 3", FIX),
    ),
    Row(
        "more-stages-than-blocks",
        "2 pipeline stages for a model of 1 block",
        "ValueError on every rank at setup",
        more_stages_than_blocks,
        "ValueError",
        (r"2 stages \(2 ranks x 1 stages per rank\)", r"only 1 blocks", FIX + r"use at most 1 stages"),
        slow=True,
    ),
    Row(
        "batch-below-microbatches",
        "pipeline batch of 2 for 8 micro-batches",
        "ValueError on every rank before the first step",
        batch_smaller_than_microbatches,
        "ValueError",
        (r"global batch 2 is not divisible by 8 microbatches x 1 replicas", FIX),
        slow=True,
    ),
    Row(
        "global-batch-below-replicas-app",
        "global_batch_size=1 on 2 processes (per-device batch 0)",
        "ConfigError before training",
        global_batch_below_replicas_app,
        "ConfigError",
        (r"global batch 1 is smaller than 2 replicas x 1 accumulation steps", r"batch of 0 samples", r"multiple of 2"),
    ),
    Row(
        "per-device-batch-zero-library",
        "lightning_strategies.global_batch_size(0, replicas=2)",
        "ValueError",
        per_device_batch_zero_library,
        "ValueError",
        (r"must be a positive integer, found 0",),
    ),
    Row(
        "empty-dataset-app",
        "data=synthetic data.num_samples=0 (a zero-length train split)",
        "ConfigError before training",
        app_rows(["data=synthetic", "data.num_samples=0"]),
        "ConfigError",
        (r"the train split has 0 samples", r"no training step would run", FIX),
    ),
    Row(
        "dataset-below-one-batch-app",
        "10 samples for 2 processes x batch 8",
        "ConfigError before training (Lightning would fit nothing)",
        app_rows(["data=synthetic", "data.num_samples=10", "data.batch_size=8", "trainer=ddp_sim"]),
        "ConfigError",
        (
            r"10 samples \(5 per replica over 2 replicas\), fewer than one per-device batch of 8",
            r"expected at least 16 samples",
            FIX,
        ),
    ),
    Row(
        "endless-run-cosine-app",
        "trainer.max_epochs=-1 (no end) with the recipe's cosine decay",
        "ValueError at configure_optimizers (it was an OverflowError on float('inf'))",
        app_rows([*[o for o in FEW_BATCHES if "max_epochs" not in o], "model=small_cnn", "trainer.max_epochs=-1"]),
        "ValueError",
        (r"scaling\.decay='cosine' decays to zero at the end of the run", r"trainer\.max_epochs=-1", FIX),
    ),
    Row(
        "empty-dataset-library",
        "Trainer.fit with an empty DataLoader",
        "Lightning's behaviour, kept: a warning and no training step",
        empty_loader_library,
        None,
        check=lightning_warns_and_takes_no_step,
    ),
    *[
        Row(
            f"corrupt-checkpoint-{kind}",
            f"ckpt_path: a {kind} file",
            "CorruptCheckpointError naming the file, what is wrong and the whole checkpoints beside it",
            corrupt_checkpoint_single(kind),
            "CorruptCheckpointError",
            (
                r"Cannot resume from checkpoint '.*last\.ckpt'",
                problem,
                r"Expected a whole checkpoint",
                FIX
                + r"pass another checkpoint as ckpt_path \(whole ones in its folder, newest first: .*epoch=0\.ckpt\)",
            ),
        )
        for kind, problem in [
            ("truncated", r"it is truncated \(\d+ bytes"),
            ("random", r"it is not a checkpoint"),
            ("empty", r"the file is empty \(0 bytes\)"),
        ]
    ],
    Row(
        "corrupt-checkpoint-app",
        "python train.py resume=<a truncated last.ckpt>",
        "the same CorruptCheckpointError from the app (it writes and reads through AtomicCheckpointIO)",
        corrupt_checkpoint_app,
        "CorruptCheckpointError",
        (r"it is truncated", r"epoch=0\.ckpt", FIX),
    ),
    Row(
        "corrupt-checkpoint-ring",
        "ckpt_path: a truncated file, 2 ring ranks",
        "the same error on every rank",
        corrupt_checkpoint_ring,
        "CorruptCheckpointError",
        (r"it is truncated", FIX),
        slow=True,
    ),
    *[
        Row(
            f"checkpoint-{src}-into-{dst}",
            f"a {src} checkpoint resumed by {dst}",
            "supported: the formats are the same (full model, full optimizer state); ends as the uninterrupted run",
            cross_load(src, dst),
            None,
            check=equals_uninterrupted_single_run,
            slow=True,
        )
        for src, dst in [("ps", "ring"), ("ring", "ps"), ("pipeline", "single"), ("single", "pipeline")]
    ],
    Row(
        "checkpoint-other-model-recipe",
        "a checkpoint of the recipe's model at width 4 resumed at width 8",
        "ValueError before the weights are loaded, naming the first differences",
        other_model_recipe,
        "ValueError",
        (
            r"the checkpoint holds another model",
            r"tensors differ in shape \(first: model\.stem\.0\.weight is "
            r"\[4, 1, 3, 3\] there, \[8, 1, 3, 3\] here\)",
            FIX + r"resume with the model settings",
        ),
    ),
    Row(
        "checkpoint-other-model-app",
        "python train.py model.width=16 resume=<a last.ckpt of model.width=8>",
        "the same ValueError from the app, before training",
        other_model_app,
        "ValueError",
        (r"the checkpoint holds another model", r"\[8, 1, 3, 3\] there, \[16, 1, 3, 3\] here", FIX),
        slow=True,
    ),
    Row(
        "checkpoint-other-model-library",
        "a checkpoint of another LightningModule shape",
        "Lightning's RuntimeError from the strict load, naming the tensor and both shapes",
        other_model_library,
        "RuntimeError",
        (
            r"size mismatch for net\.0\.weight",
            r"torch\.Size\(\[16, 8\]\) from checkpoint",
            r"current model is torch\.Size\(\[16, 5\]\)",
        ),
    ),
    Row(
        "non-finite-single",
        "NaN inputs at step 3, one process, a checkpoint every step",
        "FloatingPointError at step 3; last.ckpt still holds step 2, finite",
        non_finite_single_keeps_last_checkpoint,
        "FloatingPointError",
        (r"not finite after optimizer step 3 \(epoch 0, batch 2\)", r"loss at that step was nan", FIX),
        check=last_checkpoint_is_step_2_and_finite,
    ),
    *[
        Row(
            f"non-finite-{strategy}-{name}",
            f"{name} inputs at step 3 on {where}, {strategy}",
            "FloatingPointError on every rank at the same step",
            non_finite(strategy, value, ranks),
            "FloatingPointError",
            (r"not finite after optimizer step 3 \(epoch 0, batch 2\)", FIX),
            slow=True,
        )
        for strategy, name, value, ranks, where in [
            ("ring", "NaN", float("nan"), (1,), "rank 1 only"),
            ("ring", "inf", float("inf"), (1,), "rank 1 only"),
            ("ps", "NaN", float("nan"), (1,), "rank 1 only"),
            ("pipeline", "NaN", float("nan"), (0, 1), "the pipeline's batch"),
        ]
    ],
    Row(
        "non-finite-async-NaN",
        "NaN inputs at step 3 on rank 1 only, async",
        "FloatingPointError on every rank, each at its first check after a step that pulled the broken weights",
        non_finite("async", float("nan"), (1,)),
        "FloatingPointError",
        (r"not finite after optimizer step \d+", FIX),
        slow=True,
        # each rank reads its finite-weights flags at its own logging steps, so either may raise
        # first; the other may then fail on an RPC or a draw, its error naming the peer (lost, or
        # stopped on its error)
        races=(r"async: (lost )?peer rank [01] of 2",),
    ),
    *[
        Row(
            f"unreadable-image-workers{w}",
            "an ImageFolder with one unreadable image",
            "skipped: the next image takes its place, a warning names the file, the count is kept",
            unreadable_image_loader(w),
            None,
            check=skipped_and_counted(w),
        )
        for w in (0, 2)
    ],
    Row(
        "unreadable-image-fit-ring",
        "the same folder, trained on 2 ring ranks",
        "the skip counted once over the ranks: data/unreadable_skipped = 1 (in metrics.json for the app)",
        unreadable_image_fit,
        None,
        check=lambda ended, tmp: _equals(ended[0].value, 1.0),
        slow=True,
    ),
    Row(
        "unreadable-image-strict",
        "the same folder with skip_unreadable=False",
        "UnreadableImageError naming the file",
        unreadable_image_strict,
        "UnreadableImageError",
        (r"cannot read image '.*broken0\.png'", r"expected an image file PIL can open", FIX),
    ),
    Row(
        "mostly-unreadable-images",
        "an ImageFolder with 20 unreadable files in a row",
        "UnreadableImageError at the 16th in a row (a wrong folder, not bad luck)",
        mostly_unreadable_images,
        "UnreadableImageError",
        (
            r"16 images in a row from index 1 are unreadable \(first: '.*broken0\.png'",
            r"check that data\.root points at images",
        ),
    ),
    Row(
        "interrupted-checkpoint-write",
        "the disk fills up while last.ckpt is rewritten (3rd save)",
        "the OSError propagates; the previous last.ckpt stays whole and resumes; no temp file is left",
        interrupted_save,
        "OSError",
        (r"No space left on device",),
        check=previous_last_checkpoint_resumes,
    ),
]


def _equals(value: Any, expected: Any) -> None:
    assert value == expected, value


@pytest.mark.parametrize("row", [pytest.param(r, id=r.id, marks=[pytest.mark.slow] if r.slow else []) for r in ROWS])
def test_bad_input(row: Row, tmp_path: Path) -> None:
    ended = row.act(tmp_path)
    for e in ended:
        described = f"rank {e.rank} ended with {e.error}: {e.message[-3000:]}"
        raced = row.races is not None and e.error is not None and e.error != row.error
        assert e.error == row.error or raced, described
        for fragment in row.races if raced and row.races is not None else row.fragments:
            assert re.search(fragment, e.message), f"{fragment!r} not in: {described}"
    if row.check is not None:
        row.check(ended, tmp_path)
