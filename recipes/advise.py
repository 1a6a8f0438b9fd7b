"""Which strategy for an app recipe on a cluster: ``python -m recipes.advise recipe=... cluster=...`` (``ls-advise``).

    ls-advise recipe=resnet50_synthetic cluster=a100                  # table + advice.png
    ls-advise recipe=digits_wide_mlp cluster=emulated_2x2_50mbit --json
    python train.py strategy=advised cluster=loopback trainer=ddp_sim   # trains with the first choice

The recipe's module and one batch of its data (``data.batch_size``, the per-device batch) are
measured here (or timed from the cluster's stated ``tflops``); :mod:`lightning_strategies.advisor`
predicts and ranks every strategy. ``strategy=advised`` (``conf/strategy/advised.yaml``) builds the
first choice before the trainer is; the launching process passes its choice to the ranks it starts
(``LS_ADVISED``), so every rank builds the same strategy.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from lightning_strategies.advisor import Advice, Cluster, NoStrategyFitsError, advise, measure, to_table, write_png
from lightning_strategies.advisor.report import to_json_text

__all__ = ["advice_for", "advised_strategy", "main"]

log = logging.getLogger(__name__)
CONF = Path(__file__).resolve().parents[1] / "conf"
ENV = "LS_ADVISED"
_EXAMPLES = (__doc__ or "").split("\n\n")[1]  # the module docstring's usage lines


def _cluster(node: Any) -> Cluster:
    if isinstance(node, Cluster):
        return node
    data = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    assert isinstance(data, dict)
    return Cluster(**{str(k): v for k, v in data.items() if not str(k).startswith("_")})


def advice_for(*, cluster: Any, model: DictConfig, data: DictConfig, optimizer: DictConfig) -> Advice:
    """Measure the recipe's module on one batch of its data and advise for ``cluster``."""
    from recipes.train import build_module

    cl = _cluster(cluster)
    datamodule = instantiate(data)
    datamodule.setup("fit")
    batch = next(iter(datamodule.train_dataloader()))
    factory = instantiate(optimizer)
    module = build_module(model, datamodule, optimizer=factory, scaling=None, plan=None)
    lr = float(optimizer.get("lr", 0.1))
    m = measure(module, batch, optimizer=lambda params: factory(params, lr=lr), tflops=cl.tflops, device=cl.device)
    return advise(m, cl)


def advised_strategy(
    *, cluster: Any, model: DictConfig, data: DictConfig, optimizer: DictConfig, trainer: DictConfig | None = None
) -> Any:
    """The first choice of the advisor, built from its ``conf/strategy`` config (``strategy=advised``).

    Raises:
        NoStrategyFitsError: when no strategy fits the model in a device's memory.
    """
    key = f"{_cluster(cluster).name}|{model.get('name', model.get('_target_'))}|{data.get('batch_size')}"
    cached = json.loads(os.environ.get(ENV) or "{}")
    if cached.get("key") == key:
        name, options = cached["name"], cached["options"]
    else:
        advice = advice_for(cluster=cluster, model=model, data=data, optimizer=optimizer)
        best = advice.best()
        name, options = best.name, best.options
        from rich.console import Console

        Console(stderr=True, width=160).print(to_table(advice))
        log.info(f"strategy=advised: {' '.join(best.overrides())} on {advice.cluster.name} (predicted step "
                 f"{best.step_s:.4g} s, {best.memory.total / 2**30:.3g} GiB per device): {best.reason}")  # fmt: skip
        os.environ[ENV] = json.dumps({"key": key, "name": name, "options": options})  # for the ranks it starts
        world = advice.cluster.world
        if trainer is not None and int(trainer.get("devices", 1)) * int(trainer.get("num_nodes", 1)) != world:
            c = advice.cluster
            log.warning(
                f"strategy=advised: the advice is for {world} processes ({c.name}); the trainer runs "
                f"{trainer.get('devices')} x {trainer.get('num_nodes')}. Fix: set trainer.devices={c.per_node} "
                f"trainer.num_nodes={c.nodes}"
            )
    node = OmegaConf.load(CONF / "strategy" / f"{'ps' if name == 'ps1' else name}.yaml")
    assert isinstance(node, DictConfig)
    node.pop("defaults", None)
    return instantiate(OmegaConf.merge(node, options))


def _compose(overrides: Sequence[str], config_dir: str | None) -> DictConfig:
    with initialize_config_dir(str(Path(config_dir or CONF).resolve()), version_base="1.3"):
        return compose("train", overrides=["strategy=advised", *overrides])


class _Parser(argparse.ArgumentParser):
    """argparse whose errors also say where the options are listed."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"Error: {message}. Fix: ls-advise --help lists the options, recipes and clusters\n")


def _names(kind: str) -> str:
    return ", ".join(sorted(p.stem for p in (CONF / kind).glob("*.yaml")))


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="ls-advise",
        description="Measure an app recipe's model on one batch of its data and predict every strategy's step time, "
        "peak memory per device and bytes on the busiest link on a cluster; rank them (docs/advisor.md).",
        epilog=f"recipes (conf/recipe): {_names('recipe')}\n"
        f"clusters (conf/cluster): {_names('cluster')}; one figure changed with cluster.<field>=...\n\n"
        f"examples:\n{_EXAMPLES}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value",
        help="Hydra overrides of the app's config: recipe=..., cluster=..., data.batch_size=...",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the advice as JSON (no table, no PNG)")
    parser.add_argument(
        "--png", type=Path, default=Path("advice.png"), metavar="PATH",
        help="where the plot of step time and memory per strategy goes (default: advice.png)",
    )  # fmt: skip
    parser.add_argument("--config-dir", metavar="DIR", default=None, help="the app's configs (default: conf/)")
    return parser


def _config_error(err: HydraException) -> str:
    """Hydra's message without its config search path (the composition's internals)."""
    text = str(err).split("Config search path:")[0].strip()
    return f"Error: {text}\nFix: see above; ls-advise --help lists the recipes and clusters"


def main(argv: Sequence[str] | None = None) -> int:
    """``ls-advise [--json] [--png PATH] [--config-dir DIR] [recipe=...] [cluster=...] [key=value ...]``;
    ``--help`` lists the recipes and clusters. Returns 0, 1 when no strategy fits, 2 for a bad option or
    config."""
    try:
        args = _parser().parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as stop:  # --help (0) or a bad option (2, the message printed)
        return stop.code if isinstance(stop.code, int) else 2
    try:
        cfg = _compose(args.overrides, args.config_dir)
    except HydraException as err:
        print(_config_error(err), file=sys.stderr)
        return 2
    advice = advice_for(cluster=cfg.cluster, model=cfg.model, data=cfg.data, optimizer=cfg.optimizer)
    if args.json:
        print(to_json_text(advice))
    else:
        from rich.console import Console

        Console(width=180).print(to_table(advice))
        print(f"# measured: {advice.measurement.timed_on}; png: {write_png(advice, args.png)}")
    try:
        best = advice.best()
    except NoStrategyFitsError as err:
        print(f"Error: {err}", file=sys.stderr)
        return 1
    if not args.json:
        print(f"# first choice: python train.py {' '.join(best.overrides())}  ({best.reason})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
