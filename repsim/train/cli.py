"""`repsim train` (also ``python -m repsim.train`` / ``torchrun -m repsim.train``): train a network under one of
the nine objectives from a TOML preset (repsim/train/presets/) with ``--set key=value`` overrides."""
from __future__ import annotations

import argparse

from repsim.commands.args import add_device_option, add_progress_option

HELP = "train a network under one of the nine objectives"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", help="preset name (repsim/train/presets/NAME.toml), e.g. digits-softmax, "
                        "resnet50-imagenet-sigmoid; see --list-presets")
    parser.add_argument("--data", help="dataset: a directory (ImageFolder; DIR/train + DIR/val), 'digits', "
                        "'digits-source', 'digits-target', 'synthetic' or a torchvision name with --set data.root=DIR")
    parser.add_argument("--out", help="output directory (checkpoint.pt, best.pt, epoch-EEEE.pt with --keep-every, "
                        "metrics.jsonl/.csv, config.json)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value (dotted key, TOML literal), repeatable: "
                        "--set optim.lr=0.2 --set objective_params.tau=0.05")
    parser.add_argument("--seed", type=int, help="random seed (same as --set seed=S)")
    parser.add_argument("--objective", help="objective name or '+' combination (same as --set objective=NAME)")
    parser.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt (bitwise the uninterrupted run with "
                        "deterministic=true; a fresh start when OUT has no checkpoint)")
    parser.add_argument("--init-from", metavar="CKPT", help="fine-tuning (App. A.3): initialise the backbone "
                        "from this checkpoint's EMA weights; the head is new")
    parser.add_argument("--keep-every", type=int, metavar="K", help="also keep OUT/epoch-EEEE.pt every K epochs "
                        "(training dynamics, Figs. D.2, E.4; same as --set keep_every=K)")
    add_device_option(parser, package="PyTorch", choices=("auto", "cuda", "cpu"),
                      cuda="cuda: this process's own GPU, refused when there is none (auto falls back to the CPU "
                           "when a process on the node has no GPU of its own, and one line says so)")
    add_progress_option(parser)
    parser.add_argument("--list-presets", action="store_true", help="print the preset names and exit")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--stop-after-epoch", type=int, metavar="K", help=argparse.SUPPRESS)  # simulate preemption


def run(args: argparse.Namespace) -> int:
    """Train; bad input raises (``repsim.commands.main`` reports it on one line, exit 2; I/O 3)."""
    from .config import ConfigError, list_presets, load_config

    if args.list_presets:
        print("\n".join(list_presets()))
        return 0
    sets = list(args.sets)
    if args.seed is not None:
        sets.append(f"seed={args.seed}")
    if args.objective:
        sets.append(f'objective="{args.objective}"')
    if args.data:
        sets.append(f"data.spec={_quote(args.data)}")
    if args.keep_every is not None:
        sets.append(f"keep_every={args.keep_every}")
    if args.init_from:
        sets.append(f"finetune.init_from={_quote(args.init_from)}")
    cfg = load_config(args.preset, sets)
    if args.print_config:
        import json

        print(json.dumps(cfg, indent=2))
        return 0
    if not args.out:
        raise ConfigError("--out DIR is required")
    if not args.preset and not args.sets:
        raise ConfigError("give --preset NAME (see --list-presets) or a full config with --set")

    import torch  # noqa: F401  (heavy import only now)

    from .loop import train_run
    from .objectives import make_objective

    make_objective(cfg["objective"], 8, 2, **cfg["objective_params"])  # fail fast on bad objective
    train_run(cfg, args.out, resume=args.resume, progress=args.progress is not False,
              stop_after_epoch=args.stop_after_epoch, device=args.device)
    return 0


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
