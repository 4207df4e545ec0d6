"""What opening a training checkpoint costs `repsim extract` per store, before and now, in one run.

Each store that `repsim extract` writes from a checkpoint first opens it (``repsim.extract.sources.load_source``):
the file's sha256 (provenance), ``torch.load`` of the dict (weights, EMA weights, optimizer state) and
the network rebuilt from its config with the EMA weights.  On a GPU, where forwards are cheap, these
fixed costs are a large part of an 18-network heatmap (issue 26).  Rows, best of ``--repeats`` over
``--nets`` checkpoints of each architecture (torchvision ResNet-18 / ResNet-50 in repsim's training
format with an EMA copy and SGD momentum buffers; files in the page cache, so hashing is CPU-bound):

* ``before``: sha256 of the file, then ``torch.load``, then ``build_network`` (its initialisers draw
  random weights) and ``load_state_dict`` copying the EMA weights in — what load_source did;
* ``load_source``: what it does now — the hash on a thread beside the unpickling, and the network
  built on the meta device adopting the checkpoint's tensors (``repsim.train.checkpoint.network_from_checkpoint``);
* the parts: the ordinary build + copy against the meta build + assign, from a dict already loaded.

    python bench/checkpoint_open.py              # ~1 minute on 2 cores
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def make_checkpoints(root: Path, arch: str, nets: int) -> list[Path]:
    """``nets`` checkpoints of ``arch`` as `repsim train` writes them (model, EMA, optimizer state)."""
    import torch

    from repsim.train.checkpoint import save_checkpoint
    from repsim.train.config import load_config
    from repsim.train.models import build_network

    paths = []
    for i in range(nets):
        cfg = load_config(None, [f"arch=\"{arch}\"", "arch_params={}", "in_channels=3", "num_classes=10",
                                 "objective=\"softmax\"", f"seed={i}"])
        torch.manual_seed(i)
        net = build_network(cfg)
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        for p in net.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()  # momentum buffers, one per parameter, as a training checkpoint holds them
        state = net.state_dict()
        ema = {k: v.clone() for k, v in state.items()}
        path = root / f"{arch}-{i}" / "checkpoint.pt"
        save_checkpoint({"config": cfg, "model": state, "ema": ema, "optimizer": opt.state_dict(), "epoch": 1}, path)
        paths.append(path)
    return paths


def measure(paths: list[Path], repeats: int) -> dict:
    from _timing import best_of
    from repsim.extract.sources import load_source
    from repsim.fileio import sha256_file
    from repsim.train.checkpoint import load_checkpoint, load_state_strict, network_from_checkpoint
    from repsim.train.models import build_network

    def ordinary(ckpt: dict):
        net = build_network(ckpt["config"])
        load_state_strict(net, ckpt["ema"], "checkpoint")
        return net.eval()

    def before():
        for p in paths:
            sha256_file(p)
            ordinary(load_checkpoint(p))

    def now():
        for p in paths:
            load_source(p)

    loaded = [load_checkpoint(p) for p in paths]
    out = {
        "before_s": best_of(before, repeats),
        "load_source_s": best_of(now, repeats),
        "build_ordinary_s": best_of(lambda: [ordinary(c) for c in loaded], repeats),
        "build_meta_assign_s": best_of(lambda: [network_from_checkpoint(c) for c in loaded], repeats),
        "hash_s": best_of(lambda: [sha256_file(p) for p in paths], repeats),
        "unpickle_s": best_of(lambda: [load_checkpoint(p) for p in paths], repeats),
        "unpickle_mapped_s": best_of(lambda: [load_checkpoint(p, mmap=True) for p in paths], repeats),
        "file_mb": os.path.getsize(paths[0]) / 1e6,
    }
    net_a, net_b = ordinary(loaded[0]), network_from_checkpoint(loaded[0])
    out["same_weights"] = all(a.equal(b) for a, b in zip(net_a.state_dict().values(), net_b.state_dict().values()))
    out["ratio"] = out["before_s"] / out["load_source_s"]
    return out


def write_md(res: dict) -> None:
    from _results import replace_section

    m = res["machine"]
    lines = ["## checkpoint_open", "",
             f"`python bench/checkpoint_open.py --nets {res['nets']}` — {m['cpus']} CPUs, torch {m['torch']}, "
             f"{res['date']}; load average {m['load_start']:.1f} → {m['load_end']:.1f}; best of {res['repeats']}, "
             f"seconds for all {res['nets']} checkpoints of each architecture (files in the page cache).", "",
             "| architecture | file MB | before: hash, load, build + copy | `load_source` now | ratio | "
             "build + copy | meta build + assign | sha256 of the files | torch.load read | torch.load mapped |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for arch, r in res["rows"].items():
        lines.append(f"| {arch} | {r['file_mb']:.0f} | {r['before_s']:.3f} | {r['load_source_s']:.3f} | "
                     f"**{r['ratio']:.2f}×** | {r['build_ordinary_s']:.3f} | {r['build_meta_assign_s']:.3f} | "
                     f"{r['hash_s']:.3f} | {r['unpickle_s']:.3f} | {r['unpickle_mapped_s']:.3f} |")
    lines += ["", "Same weights from both builds: " + ", ".join(f"{a} {r['same_weights']}" for a, r in res["rows"].items())
              + ". `load_source` also builds the store's model metadata (a few ms). What is left is mostly the "
              "file's sha256 (the store's provenance, `model.checkpoint_sha256`), computed on a thread beside the "
              "mapped load and the build, so on a free core it hides them; the mapped tensors are read when the "
              "network first touches them (its first forward).", ""]
    replace_section("checkpoint_open", "\n".join(lines))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nets", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--archs", nargs="+", default=["resnet18", "resnet50"])
    ap.add_argument("--out", default=str(HERE / "results" / "checkpoint_open.json"))
    ap.add_argument("--no-markdown", action="store_true")
    args = ap.parse_args()
    import datetime

    import torch

    res = {"benchmark": "checkpoint_open", "nets": args.nets, "repeats": args.repeats,
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
                       "torch_threads": torch.get_num_threads(), "load_start": os.getloadavg()[0]}, "rows": {}}
    root = Path(tempfile.mkdtemp(prefix="repsim-ckpt-open-"))
    try:
        for arch in args.archs:
            paths = make_checkpoints(root, arch, args.nets)
            res["rows"][arch] = r = measure(paths, args.repeats)
            print(f"{arch}: before {r['before_s']:.3f} s, load_source {r['load_source_s']:.3f} s ({r['ratio']:.2f}x); "
                  f"build+copy {r['build_ordinary_s']:.3f} s vs meta+assign {r['build_meta_assign_s']:.3f} s; "
                  f"hash {r['hash_s']:.3f} s, torch.load {r['unpickle_s']:.3f} s / mapped {r['unpickle_mapped_s']:.3f} s "
                  f"({args.nets} x {r['file_mb']:.0f} MB)",
                  flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    res["machine"]["load_end"] = os.getloadavg()[0]
    from _results import provenance

    res["provenance"] = provenance()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    from _results import records

    if records(args.out, HERE / "results" / "checkpoint_open.json", no_markdown=args.no_markdown):
        write_md(res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
