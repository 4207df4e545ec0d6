"""`repsim finetune`: fine-tuning transfer with the protocol of App. A.3 (Table 2).

    repsim finetune --preset finetune-resnet50 --init-from 'runs/*/best.pt' --data /data/food101 \\
        --holdout-size 7500 --out ft/food --results results/ [--metric top1|mean_per_class] [--jobs 4]

For every objective among the ``--init-from`` checkpoints (grouped by objective, its parameters and
training variant; the checkpoints of one group are its pretrained seeds): 20,000 steps of SGD with
momentum 0.9 and cosine annealing, standard augmentation (the ``finetune-*`` presets), on a grid of 8
log-spaced learning rates in [10^-5.5, 10^-1] × 8 log-spaced weight decays in [10^-6.5, 10^-3] plus no
decay (decay divided by the learning rate, ``repsim.train.config.finetune_grid``); the point with the best
holdout accuracy averaged over the group's seeds is chosen, every seed is retrained on train + holdout
and tested (top-1, or mean per-class accuracy for datasets that ask for it, App. A.2). The protocol and
the output layout: :mod:`repsim.train.tune`. ``--results DIR`` merges one row per retrained network into
``DIR/finetune.csv`` (docs/architecture.md "Results files"), the input of Table 2.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

HELP = "fine-tune pretrained checkpoints on a transfer dataset with the App. A.3 grid (Table 2)"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", required=True, help="fine-tuning preset (finetune-resnet50, finetune-digits)")
    parser.add_argument("--init-from", nargs="+", required=True, metavar="CKPT",
                        help="pretrained checkpoints (globs expanded); grouped by objective, one group's "
                        "checkpoints are its pretrained seeds (A.3 averages the holdout accuracy over them)")
    parser.add_argument("--data", help="transfer dataset spec (default: the preset's)")
    parser.add_argument("--out", required=True, type=Path, help="output directory (runs, grid.csv, selection.json)")
    parser.add_argument("--results", type=Path, help="merge the retrained networks' rows into RESULTS/finetune.csv")
    parser.add_argument("--task", help="task name in the results (default: the dataset's name)")
    parser.add_argument("--metric", choices=("top1", "mean_per_class"), default="top1",
                        help="accuracy measure of the dataset (App. A.2: mean per-class for Pets, Flowers)")
    parser.add_argument("--steps", type=int, help="optimizer steps per run (A.3: 20,000; default: the preset's)")
    parser.add_argument("--lr-grid", nargs=3, type=float, metavar=("LO", "HI", "N"), default=(-5.5, -1.0, 8),
                        help="log10 range and count of learning rates (default -5.5 -1 8, A.3)")
    parser.add_argument("--wd-grid", nargs=3, type=float, metavar=("LO", "HI", "N"), default=(-6.5, -3.0, 8),
                        help="log10 range and count of weight decays λ (default -6.5 -3 8, A.3); the decay "
                        "coefficient is λ / learning rate")
    parser.add_argument("--no-zero-decay", action="store_true", help="leave 'no weight decay' out of the grid")
    parser.add_argument("--holdout-size", type=int, help="validation examples held out of the training split "
                        "for the grid (same as --set data.holdout_size=N; image folders, CSV files and torchvision "
                        "datasets: digits and Fashion-MNIST have fixed holdout splits)")
    from .tune import add_run_arguments

    add_run_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Bad arguments and failed runs raise (one line from ``repsim.commands.main``)."""
    from .config import finetune_grid, load_config
    from .tune import check_jobs, parse_sets, toml_literal, tune, write_rows

    placement = check_jobs(args)
    for name, (lo, hi, n) in (("--lr-grid", args.lr_grid), ("--wd-grid", args.wd_grid)):
        if n < 1 or n != int(n) or hi < lo:
            raise ValueError(f"{name} wants LO <= HI and a whole count N >= 1, got {lo:g} {hi:g} {n:g}")
    sets = parse_sets(args.sets, args.data)
    if args.holdout_size is not None:
        sets.append(("data.holdout_size", args.holdout_size))
    if args.steps is not None:
        if args.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {args.steps}")
        sets.append(("max_steps", args.steps))
    sets.append(("optim.wd_over_lr", True))
    groups, arch_sets = source_groups(args.init_from)
    base = arch_sets + sets
    cfg = load_config(args.preset, [f"{k}={toml_literal(v)}" for k, v in base])
    if cfg["optim"]["ref_batch"] != cfg["batch_size"]:
        # the grid's learning rates are the rates used (A.3's range), whatever the batch size: no
        # linear scaling by batch_size / ref_batch, so λ / η is the decay coefficient of the rate used and
        # finetune.csv's lr is the peak learning rate of the run
        print(f"[finetune] batch size {cfg['batch_size']} (ref_batch {cfg['optim']['ref_batch']}): the grid's "
              "learning rates are used as given (optim.ref_batch set to the batch size)", flush=True)
        base = base + [("optim.ref_batch", cfg["batch_size"])]
        cfg = load_config(args.preset, [f"{k}={toml_literal(v)}" for k, v in base])
    check_holdout(cfg)
    grid = finetune_grid((args.lr_grid[0], args.lr_grid[1], int(args.lr_grid[2])),
                         (args.wd_grid[0], args.wd_grid[1], int(args.wd_grid[2])), no_decay=not args.no_zero_decay)
    task = args.task or _dataset_name(cfg)
    for g in groups:
        g.info.update(task=task, preset=args.preset)
    # fixed-length runs: the holdout is evaluated once, at the end
    rows = tune(preset=args.preset, base_sets=base, grid=grid, groups=groups, out=args.out, metric=args.metric,
                select_on="last", jobs=args.jobs, nproc=args.nproc_per_node, keep_checkpoints=args.keep_checkpoints,
                grid_sets=[("eval_every", 10**9)], say=lambda m: print(m, flush=True), placement=placement,
                results="finetune")
    for r in rows:
        point = json.loads(r["selected"])
        r["lr"], r["weight_decay"] = point["optim.lr"], point["optim.weight_decay"]
    if args.results:
        write_rows(args.results / "finetune.csv", rows, "finetune", merge=True)
    write_rows(args.out / "results.csv", rows, "finetune")
    for r in rows:
        print(f"{r['objective']}{' ' + r['variant'] if r['variant'] else ''} seed {r['seed']} on {task}: "
              f"test {args.metric} {r['accuracy']:.2f}% (lr {r['lr']:.3g}, weight decay {r['weight_decay']:.3g}; "
              f"mean holdout {r['holdout_accuracy']:.2f}%)")
    print(f"repsim finetune: {len(rows)} network(s) -> {args.out / 'results.csv'}"
          + (f", {args.results / 'finetune.csv'}" if args.results else ""))
    return 0


def source_groups(patterns: list[str]):
    """The ``--init-from`` checkpoints as :class:`repsim.train.tune.Group` s (one per objective, parameters and
    variant) and the ``--set`` pairs that give the fine-tuned network their architecture."""
    from repsim.paths import expand_paths

    from .checkpoint import load_checkpoint
    from .tune import Group, Replicate, TuneError

    paths = expand_paths(patterns, "file", "finetune: --init-from")
    groups: dict[str, Group] = {}
    arch = None
    for path in paths:
        cfg = load_checkpoint(path)["config"]
        this = {"arch": cfg.get("arch"), "arch_params": cfg.get("arch_params", {}),
                "in_channels": int(cfg.get("in_channels", 3))}
        if arch is not None and this != arch:
            raise TuneError(f"--init-from checkpoints of different architectures: {arch} and {this} ({path})")
        arch = this
        params = json.dumps(cfg.get("objective_params", {}), sort_keys=True)
        variant = cfg.get("variant", "") or ""
        name = "-".join(p for p in (cfg.get("objective", "?").replace("+", "_"), variant.replace("+", "_")) if p)
        key = json.dumps([cfg.get("objective"), params, variant])
        g = groups.get(key)
        if g is None:
            taken = {x.name for x in groups.values()}
            base, i = name, 2
            while name in taken:
                name, i = f"{base}-{i}", i + 1
            g = groups[key] = Group(name, [], {"objective": cfg.get("objective"), "params": params, "variant": variant})
        seed = cfg.get("seed")
        rname = f"s{seed}"
        if any(r.name == rname for r in g.replicates):
            rname = f"s{seed}-{len(g.replicates)}"
        g.replicates.append(Replicate(rname, (("finetune.init_from", str(Path(path).resolve())),),
                                      {"seed": seed, "source_checkpoint": str(Path(path).resolve())}))
    if arch is None:
        raise TuneError("--init-from matched no checkpoint")
    return list(groups.values()), [(k, v) for k, v in arch.items()]


def check_holdout(cfg: dict) -> None:
    """Phase 1 selects on the holdout split: refuse a dataset without one, before any training."""
    from .data import FixedHoldoutError, dataset_from_config
    from .tune import TuneError

    try:
        n = len(dataset_from_config(cfg, "holdout"))
    except FixedHoldoutError as e:
        raise TuneError(str(e)) from None
    except ValueError as e:
        raise TuneError(f"the grid is scored on a holdout split, and {cfg['data']['spec']!r} has none ({e}); "
                        "pass --holdout-size N") from None
    if n == 0:
        raise TuneError(f"the holdout split of {cfg['data']['spec']!r} is empty; pass --holdout-size N")


def _dataset_name(cfg: dict) -> str:
    spec = str(cfg["data"]["spec"])
    return Path(spec).name if "/" in spec else spec
