"""`repsim tune`: choose hyperparameters on the holdout over several seeds, then retrain on train + holdout.

    repsim tune --preset resnet50-imagenet-softmax-mixup --data /data/imagenet --seeds 0 1 2 --out tune/mixup \\
        [--grid mixup.alpha=0.1,0.2,0.3,0.4] [--select-on best|last] [--results results/]

The App. A.1 tuning protocol (:mod:`repsim.train.tune`): every grid point is trained with each seed on the
training split and scored on the holdout split, by default at its best epoch (``--select-on best``: the
early-stopping epoch is tuned with the hyperparameters); the point (and epoch) with the best holdout
accuracy averaged over the seeds is chosen; each seed is retrained on train + holdout, stopped at that
epoch, and evaluated on the test split. The grid defaults to the preset's ``tune_grid`` (the ``*-mixup``
presets: Mixup α ∈ {0.1, 0.2, 0.3, 0.4}, App. C.4, Table C.5). ``--results DIR`` merges one row per
retrained network into ``DIR/tune.csv``; ``repsim runs OUT/*/final/*`` collects their training curves.
"""
from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

HELP = "choose hyperparameters on the holdout over seeds, retrain on train+holdout (Mixup alpha, App. C.4)"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", required=True, help="training preset, e.g. digits-softmax-mixup")
    parser.add_argument("--data", help="dataset spec (default: the preset's)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], help="training seeds averaged for selection")
    parser.add_argument("--grid", nargs="+", default=None, metavar="KEY=V1,V2,...",
                        help="grid axes (their product is searched), e.g. mixup.alpha=0.1,0.2,0.3,0.4; "
                        "default: the preset's tune_grid")
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument("--results", type=Path, help="merge the retrained networks' rows into RESULTS/tune.csv")
    parser.add_argument("--metric", choices=("top1", "mean_per_class"), default="top1")
    parser.add_argument("--select-on", choices=("best", "last"), default="best",
                        help="holdout score of a run: its best epoch (default; the stopping epoch is tuned "
                        "too, App. A.1) or its last")
    from .tune import add_run_arguments

    add_run_arguments(parser)


def parse_grid(items: list[str]) -> dict[str, list]:
    """``["a.b=1,2", "c=x,y"]`` → {"a.b": [1, 2], "c": ["x", "y"]} (TOML literals, else strings)."""
    from .config import parse_value

    axes: dict[str, list] = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--grid expects KEY=V1,V2,..., got {item!r}")
        k, v = item.split("=", 1)
        values = [parse_value(x.strip()) for x in v.split(",") if x.strip()]
        if not values:
            raise ValueError(f"--grid {k}: no values")
        axes[k.strip()] = values
    return axes


def run(args: argparse.Namespace) -> int:
    """Bad arguments and failed runs raise (one line from ``repsim.commands.main``)."""
    from .config import load_config, validate
    from .finetune_cli import check_holdout
    from .tune import Group, Replicate, check_jobs, parse_sets, toml_literal, tune, write_rows

    placement = check_jobs(args)
    sets = parse_sets(args.sets, args.data)
    cfg = load_config(args.preset, [f"{k}={toml_literal(v)}" for k, v in sets])
    axes = parse_grid(args.grid) if args.grid else {k: list(v) for k, v in cfg.get("tune_grid", {}).items()}
    if not axes:
        raise ValueError(f"no grid: pass --grid KEY=V1,V2,... (preset {args.preset!r} has no tune_grid)")
    for k, values in axes.items():  # validate every value before training anything
        for v in values:
            validate(load_config(args.preset, [f"{k}={toml_literal(v)}"]))
    check_holdout(cfg)
    grid = [dict(zip(axes, combo)) for combo in itertools.product(*axes.values())]
    params = json.dumps(cfg.get("objective_params", {}), sort_keys=True)
    from .augment import variant_of

    variant = variant_of(cfg)
    group = Group("-".join(p for p in (cfg.get("objective", "run"), variant) if p).replace("+", "_"),
                  [Replicate(f"s{s}", (("seed", s),), {"seed": s}) for s in dict.fromkeys(args.seeds)],
                  {"preset": args.preset, "objective": cfg.get("objective"), "params": params, "variant": variant,
                   "grid": json.dumps(axes, default=str)})
    rows = tune(preset=args.preset, base_sets=sets, grid=grid, groups=[group], out=args.out, metric=args.metric,
                select_on=args.select_on, jobs=args.jobs, nproc=args.nproc_per_node,
                keep_checkpoints=args.keep_checkpoints, say=lambda m: print(m, flush=True), placement=placement)
    if args.results:
        write_rows(args.results / "tune.csv", rows, "tune", merge=True)
    for r in rows:
        print(f"{args.preset} seed {r['seed']}: selected {r['selected']}"
              + (f" epoch {r['selected_epoch']}" if r["selected_epoch"] != "" else "")
              + f"; test {args.metric} {r['accuracy']:.2f}%")
    print(f"repsim tune: {len(rows)} network(s) -> {args.out / 'results.csv'}"
          + (f", {args.results / 'tune.csv'}" if args.results else ""))
    return 0
