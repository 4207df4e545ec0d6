"""The pixel baseline of the demo's transfer task: the linear probe of `repsim probe` (App. A.2's protocol:
λ chosen on a 20 % validation split, refit, scored on the test split) on raw input pixels instead of a
network's features, on exactly the images the transfer stores hold (the target's fit and test splits
built from a run's config, as `repsim extract` builds them). Features can only be said to transfer
when they beat this.

Run as ``python -m repsim.analyses.pixel_baseline RUN_DIR FIT_SPEC TEST_SPEC TASK OUT_CSV`` (a subprocess of the
demo's analyse stage: building the datasets imports torch, the analyses do not).
"""
from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import numpy as np

COLUMNS = ["task", "features", "probe", "metric", "accuracy", "best_param", "n_train", "n_test", "dim"]


def pixels(config: dict, spec: str, split: str) -> tuple[np.ndarray, np.ndarray]:
    """(N, C·H·W) float32 input pixels (the run's evaluation transform: resize, standardisation) and labels."""
    from repsim.train.data import dataset_from_config

    ds = dataset_from_config(config, split, spec=spec)
    stacked = ds.image_tensor()
    if stacked is None:
        import torch

        stacked = (torch.stack([ds[i][0] for i in range(len(ds))]), np.asarray(ds.targets))
    x, y = stacked
    return x.reshape(len(x), -1).numpy().astype(np.float32), np.asarray(y)


def baseline_row(run_dir: Path, fit_spec: str, test_spec: str, task: str) -> dict:
    from repsim.probes.linear import linear_probe

    config = json.loads((Path(run_dir) / "config.json").read_text())
    xf, yf = pixels(config, fit_spec, "train")
    xt, yt = pixels(config, test_spec, "test")
    r = linear_probe(xf, yf, xt, yt)
    return dict(task=task, features="pixels", probe="linear", metric=r.metric, accuracy=float(r.accuracy),
                best_param=float(r.best_param), n_train=len(yf), n_test=len(yt), dim=xf.shape[1])


def main(argv: list[str]) -> None:
    run_dir, fit_spec, test_spec, task, out = argv
    row = baseline_row(Path(run_dir), fit_spec, test_spec, task)
    tmp = Path(out).with_suffix(".tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, COLUMNS)
        w.writeheader()
        w.writerow(row)
    tmp.replace(out)
    print(f"pixels {task}: linear {100 * row['accuracy']:.2f}% ({row['n_train']} fit, {row['n_test']} test, "
          f"{row['dim']} pixels, λ {row['best_param']:.3g})")


if __name__ == "__main__":
    main(sys.argv[1:])
