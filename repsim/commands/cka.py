"""`repsim cka`: CKA between every (store, layer) pair, streamed from stores (paper §3.2, Fig. 2)."""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Any, Iterator

from repsim.commands.main import CommandError
from repsim.commands.args import add_deprecated, gib_to_bytes, non_negative, positive
from repsim.commands._stream import PAIRS_MEMORY, add_store_arguments, layers_arg, stream_options
from repsim.engine.options import DEFAULT_BUDGETS

HELP = "minibatch CKA between every (store, layer) pair"


def configure(parser: argparse.ArgumentParser) -> None:
    add_pair_arguments(parser, out_help="result file (.npz: CKAResult.save, repsim.load_result; e.g. cka_resnet50.npz)")


def add_pair_arguments(parser: argparse.ArgumentParser, *, out_help: str) -> None:
    """The options of `repsim cka` that `repsim similarity` shares: stores, batches, resume, refusals."""
    add_store_arguments(parser, out_help=out_help, memory_default=DEFAULT_BUDGETS["similarity"],
                        memory_bounds=PAIRS_MEMORY)
    parser.add_argument("--method", choices=("minibatch", "exact"), default="minibatch",
                        help="minibatch (default, the paper's: unbiased HSIC over batches) or exact (full-data, "
                             "float64; it runs in this process, also with --scheduler)")
    parser.add_argument("--batch-size", type=positive, default=1500, help="minibatch size (default 1500, paper)")
    parser.add_argument("--epochs", type=positive, default=None,
                        help="passes over the data (default 10, paper; one when every pass would cut the same "
                             "batches: a batch of all n examples, or --shuffle none; said when you ask for more)")
    parser.add_argument("--seed", type=non_negative, default=0, help="shuffling seed (default 0)")
    parser.add_argument("--shuffle", choices=("window", "examples", "none"), default="window",
                        help="window: permute chunk blocks and rows within windows, each chunk read once per "
                             "epoch (default); examples: uniform permutation, ~n/batch reads per epoch (both cut "
                             "round(n/batch) near-equal batches per epoch); none: consecutive batches [0:b], "
                             "[b:2b], ... as a DataLoader cuts them")
    parser.add_argument("--no-shuffle", dest="shuffle", action="store_const", const="none",
                        help="same as --shuffle none")
    parser.add_argument("--shuffle-window", type=positive, default=None, metavar="ROWS",
                        help="rows per shuffle window (default 4 x batch size)")
    parser.add_argument("--biased", action="store_true", help="biased HSIC (default: debiased, as in the paper)")
    parser.add_argument("--compute-dtype", choices=("float32", "float64"), default=None,
                        help="precision of the batch Grams (default: float32 for float16/float32 layers, "
                             "float64 for float64 ones; centring, slab and HSIC sums are float64 either way)")
    add_deprecated(parser, "--max-memory", dest="memory_budget", convert=gib_to_bytes, metavar="GIB",
                   instead="--memory-budget {value}GiB")
    # dest "checkpoint": the file the run checkpoints to and resumes from (output_and_checkpoint)
    parser.add_argument("--resume", dest="checkpoint", default=None, metavar="FILE",
                        help="the checkpoint an interrupted run resumes from, written as the run goes and removed "
                             "when it ends (default: OUT.ckpt.npz beside --out; a rerun resumes from it by itself)")
    add_deprecated(parser, "--checkpoint", dest="checkpoint", metavar="FILE", instead="--resume {value}")
    parser.add_argument("--checkpoint-every", type=positive, default=8, metavar="BATCHES",
                        help="batches per checkpointed segment (default 8)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    parser.add_argument("--allow-mixed-datasets", action="store_true",
                        help="combine stores whose dataset name/split or labels differ (default: refused; "
                             "their example_ids only align by coincidence)")


def output_and_checkpoint(args: argparse.Namespace) -> tuple[str, str]:
    """(the ``--out`` file, its checkpoint file) of ``repsim cka``/``similarity``; an existing ``--out`` is
    refused without ``--overwrite``, and a checkpoint path that is the output, or an existing file that
    is not a repsim checkpoint, is refused (:func:`repsim.engine.checkpoint.check_checkpoint_path`),
    all before any work. A checkpoint no newer than an existing ``--out`` is the leftover of the
    run that wrote it (killed between writing the output and removing the checkpoint): it is removed, with a
    note, so that a later ``--overwrite`` starts afresh instead of meeting a finished run's checkpoint."""
    from repsim.engine.checkpoint import check_checkpoint_path, npz_path

    out = npz_path(args.out)
    if os.path.isdir(out) or (os.path.exists(out) and not args.overwrite):
        raise CommandError(f"--out {out} already exists; pass --overwrite to replace it or choose another --out")
    named, flag = _checkpoint_arg(args)
    ckpt = check_checkpoint_path(named or (out[:-4] + ".ckpt.npz"), out, flag=flag)
    if os.path.isfile(out) and os.path.isfile(ckpt) and os.path.getmtime(ckpt) <= os.path.getmtime(out):
        print(f"repsim: removing {ckpt}, left by the finished run that wrote {out}", file=sys.stderr)
        os.remove(ckpt)
    return out, ckpt


def _checkpoint_arg(args: argparse.Namespace) -> tuple[str | None, str]:
    """(the checkpoint path the user named, the flag to name it by in messages): ``--resume`` (its
    older spelling ``--checkpoint`` fills the same ``dest`` and has had its deprecation notice);
    (None, "checkpoint") for the default path."""
    for dest in ("resume", "checkpoint"):
        value = getattr(args, dest, None)
        if isinstance(value, str) and value:
            return value, "--resume"
    return None, "checkpoint"


@contextlib.contextmanager
def claimed_outputs(args: argparse.Namespace) -> Iterator[tuple[str, str]]:
    """:func:`output_and_checkpoint`, with both files held for the run (:func:`repsim.fileio.claim_output`):
    a second run writing the same ``--out`` or checkpoint is refused at its start, in one line, instead
    of both printing "-> OUT" while the file holds only the last finisher's result."""
    from repsim.fileio import claim_output

    out, ckpt = output_and_checkpoint(args)
    with claim_output(out, overwrite=True), claim_output(ckpt, overwrite=True, what=_checkpoint_arg(args)[1]):
        yield out, ckpt


def finish(result: Any, args: argparse.Namespace, out: str, ckpt: str) -> str:
    """Save ``result`` to ``out`` (a create that fails when another run made it since the start, unless
    ``--overwrite``) and remove this run's checkpoint (a minibatch run's only: an exact run neither
    reads nor writes one, and leaves any there for the run that made it)."""
    path = result.save(out, overwrite=bool(args.overwrite))
    if args.method == "minibatch" and os.path.exists(ckpt):
        os.remove(ckpt)
    return path


def run(args: argparse.Namespace) -> int:
    from repsim.engine.minibatch import cka_matrix

    with claimed_outputs(args) as (out, ckpt):
        result = cka_matrix(args.stores, layers=layers_arg(args.layers), batch_size=args.batch_size,
                            epochs=args.epochs, seed=args.seed, shuffle=args.shuffle, spatial=args.spatial,
                            debiased=not args.biased, method=args.method, shuffle_window=args.shuffle_window,
                            checkpoint=ckpt if args.method == "minibatch" else None,
                            checkpoint_every=args.checkpoint_every, allow_mixed_datasets=args.allow_mixed_datasets,
                            stream=stream_options(args))
        path = finish(result, args, out, ckpt)
    print(f"repsim cka: {len(result.index)}x{len(result.index)} CKA over {len(result.stores)} store(s), "
          f"n={result.meta['n']} -> {path}", file=sys.stderr)
    return 0
