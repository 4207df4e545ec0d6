"""Coverage of the toolkit's intervals on simulated data with a known population value.

The simulations of tests/coverage_sim.py (which tests/test_coverage.py checks at a few hundred replicates)
run at ``--reps`` replicates each:

* ``MinibatchCKA.ci`` (and so ``CKAResult.ci``, ``SimilarityResult.ci`` of linear and RBF CKA) at 8, 16,
  32 and 64 batches of one pass, over 3 epochs of the same examples (draws = batches per epoch), and past
  ``max_records`` (records of 2 batches, every record resampled, the spread widened);
* finding 2's ``bootstrap_gaps`` (repsim/analyses/findings.py) over 9 objectives (the paper's) and 30;
* the exact route's delete-a-group jackknife (``SimilarityResult.ci`` of an exact measure,
  ``jackknife=G``; repsim/kernels/jackknife.py) of debiased and biased linear CKA, 20 groups.

Each row: the fraction of replicates whose nominal-95 % interval holds the truth, with its binomial
standard error. These are the numbers docs/architecture.md and the docstrings quote. Statistics, not
speed: the numbers do not depend on the machine (seeded), only the run time does.

    python bench/coverage.py               # ~2 min on 2 cores; rewrites bench/RESULTS.md "coverage"
    python bench/coverage.py --reps 300    # a quick look (not recorded)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):  # small products: one thread each
    os.environ.setdefault(_var, "1")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
DEFAULT_OUT = os.path.join(HERE, "results", "coverage.json")

CKA_CASES = [  # (label, keyword arguments of coverage_sim.cka_coverage)
    ("1 pass, 8 batches", dict(batches=8)),
    ("1 pass, 16 batches", dict(batches=16)),
    ("1 pass, 32 batches", dict(batches=32)),
    ("1 pass, 64 batches", dict(batches=64)),
    ("3 epochs of 40 batches, draws = 40", dict(batches=40, epochs=3)),
    ("1 pass, 128 batches in 64 records of 2", dict(batches=128, max_records=64)),
]

JACKKNIFE_CASES = [  # (label, keyword arguments of coverage_sim.jackknife_coverage)
    ("debiased linear CKA, n = 40, 20 groups", dict(n=40, groups=20, debiased=True)),
    ("biased linear CKA, n = 40, 20 groups", dict(n=40, groups=20, debiased=False)),
    ("biased linear CKA, n = 120, 20 groups", dict(n=120, groups=20, debiased=False)),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=2000, help="simulated data sets per row (default 2000)")
    ap.add_argument("--out", default=DEFAULT_OUT,
                    help="results JSON; bench/RESULTS.md is rewritten only when this is the default")
    ap.add_argument("--no-results", "--no-markdown", dest="no_results", action="store_true",
                    help="do not rewrite bench/RESULTS.md")
    args = ap.parse_args()
    import numpy as np
    from coverage_sim import Gaussian, Objectives, cka_coverage, gaps_coverage, jackknife_coverage

    def se(c: float, n: int) -> float:
        return float(np.sqrt(c * (1 - c) / n))

    t0 = time.time()
    model = Gaussian()
    rows, record = [], {"reps": args.reps, "cka": {}, "finding2": {}, "jackknife": {},
                        "model": {"cka": vars(model) | {"population_cka": model.population_cka(), "batch": 24},
                                  "finding2": vars(Objectives())}}
    for k in (9, 30):
        got = gaps_coverage(Objectives(), args.reps, k=k, n_boot=2000)
        record["finding2"][f"{k} objectives"] = {key: {"coverage": v["coverage"], "se": se(v["coverage"], args.reps)}
                                                 for key, v in got.items()}
        for key, v in got.items():
            rows.append(f"| finding 2 bootstrap_gaps | {k} objectives, {key} gap | "
                        f"{100 * v['coverage']:.1f} ± {100 * se(v['coverage'], args.reps):.1f} |")
            print(rows[-1], flush=True)
    for label, kw in CKA_CASES:
        got = cka_coverage(model, args.reps, b=24, **kw)
        record["cka"][label] = {"coverage": got["coverage"], "se": se(got["coverage"], args.reps),
                                "mean_width": float(got["width"])}
        cov = got["coverage"]
        rows.append(f"| MinibatchCKA.ci | {label} | {100 * cov:.1f} ± {100 * se(cov, args.reps):.1f} |")
        print(rows[-1], flush=True)
    for label, kw in JACKKNIFE_CASES:
        got = jackknife_coverage(model, args.reps, **kw)
        cov = got["coverage"]
        record["jackknife"][label] = {"coverage": cov, "se": se(cov, args.reps), "mean_width": got["width"],
                                      "mean_bias": got["bias"]}
        rows.append(f"| exact-route jackknife | {label} (estimator's bias {got['bias']:+.3f}) | "
                    f"{100 * cov:.1f} ± {100 * se(cov, args.reps):.1f} |")
        print(rows[-1], flush=True)
    record["seconds"] = time.time() - t0
    table = "\n".join(rows)
    section = f"""## coverage

`python bench/coverage.py` ({args.reps} simulated data sets per row, seeded; tests/coverage_sim.py): the
percentage of nominal-95 % intervals that hold the population value, ± its binomial standard error. CKA:
two Gaussian layers (6 and 4 features, population linear CKA {model.population_cka():.3f}), batches of 24.
Finding 2: objectives drawn from a population with per-objective and per-pair effects (12 layers, 4 late).

| interval | case | coverage % |
| --- | --- | --- |
{table}
"""
    print(section)
    from _results import provenance, records, replace_section

    record["provenance"] = provenance()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    if records(args.out, DEFAULT_OUT, no_markdown=args.no_results):
        replace_section("coverage", section)
    else:
        print(f"wrote {args.out}; bench/RESULTS.md left alone (--no-results or --out elsewhere)")


if __name__ == "__main__":
    main()
