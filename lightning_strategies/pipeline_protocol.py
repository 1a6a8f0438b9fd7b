"""The contract between a LightningModule and :class:`~lightning_strategies.strategies.pipeline.PipelineStrategy`."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from torch import Tensor, nn

__all__ = ["PipelineModule", "check_pipeline_module"]


@runtime_checkable
class PipelineModule(Protocol):
    """A LightningModule that a pipeline strategy can split into stages.

    A pipeline cannot split an arbitrary ``forward``: it needs the model as ordered blocks, each consuming the
    previous one's output, and the loss of the last block's output. A module opts in by adding these two methods (its
    ``*_step`` methods stay as they are). Both are called on every rank; the blocks must share their parameters with
    the module, so the optimizer from ``configure_optimizers`` and the checkpoint keep describing the whole model.
    """

    def pipeline_layers(self) -> nn.Sequential:
        """The model as an ordered sequence of blocks; running them in order computes ``self(x)``."""
        ...

    def pipeline_loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        """The loss of one micro-batch, a mean over its samples (as ``training_step`` computes it)."""
        ...


def check_pipeline_module(module: Any) -> None:
    """Raise ``TypeError``, naming the missing methods and what each must return, when ``module`` does not
    implement :class:`PipelineModule`."""
    missing = [name for name in ("pipeline_layers", "pipeline_loss") if not callable(getattr(module, name, None))]
    if missing:
        raise TypeError(
            f"{type(module).__name__} does not implement lightning_strategies.PipelineModule: missing "
            f"{', '.join(missing)}. Expected `pipeline_layers() -> torch.nn.Sequential` (the model as "
            "ordered blocks sharing its parameters) and `pipeline_loss(outputs, targets) -> Tensor` (the "
            "mean loss of a micro-batch). Fix: add both methods to the module, or use strategy='ddp'."
        )
