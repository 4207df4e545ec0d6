"""`repsim figures` on small synthetic results files (written directly in the formats of docs/architecture.md "Results files")."""
from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pytest

from repsim.commands.main import main

OBJS = ["softmax", "sigmoid", "cosine_softmax", "squared_error"]
SEEDS = [0, 1]
LAYERS = ["block1", "block2", "block3", "block4", "pool"]
TASKS = ["taskA", "taskB"]


def _store(o, s):
    return f"{o}-s{s}-test"


def write_results(root, *, rng=None, epochs=(1, 2, 3)):
    """A results directory with every CSV, one CKA file and spectra; returns its path."""
    rng = rng or np.random.default_rng(0)
    res = root / "results"
    res.mkdir()
    rank = {o: i for i, o in enumerate(OBJS)}  # later objective: more separation, worse transfer
    sep, spa, col, pro, tra = [], [], [], [], []
    for o in OBJS:
        for s in SEEDS:
            st = _store(o, s)
            for li, layer in enumerate(LAYERS):
                depth = li / (len(LAYERS) - 1)
                for d in ("cosine", "cosine_centered", "sqeuclidean"):
                    r2 = 0.05 + 0.3 * depth + 0.15 * depth * rank[o] + rng.normal(0, 0.005)
                    sep.append(dict(store=st, objective=o, seed=s, layer=layer, distance=d, r2=r2))
                spa.append(dict(store=st, objective=o, seed=s, layer=layer,
                                nonzero_fraction=0.9 - 0.3 * depth - 0.1 * depth * rank[o] + rng.normal(0, 0.01)))
                col.append(dict(store=st, objective=o, seed=s, layer=layer, norm_cv_means=rng.uniform(0.1, 0.2),
                                cos_std_means=rng.uniform(0.05, 0.1), equiangular_means=rng.uniform(0, 0.1),
                                nc1=10.0 / (1 + rank[o]) + rng.normal(0, 0.1), self_duality=rng.uniform(0.3, 0.9)))
            for probe in ("linear", "knn"):
                for task in TASKS + ["source"]:
                    acc = 0.9 - 0.05 * rank[o] + rng.normal(0, 0.004) if task != "source" else 0.8 + 0.03 * rank[o]
                    pro.append(dict(store=st, objective=o, seed=s, task=task, probe=probe, metric="top1",
                                    accuracy=acc, best_param=1e-3 if probe == "linear" else 5))
            for e in epochs:
                for split, base in (("train", 0.9), ("test", 0.8)):
                    top1 = base - 0.1 / e + 0.01 * rank[o] + rng.normal(0, 0.003)
                    tra.append(dict(run=f"{o}-s{s}", objective=o, seed=s, epoch=e, split=split,
                                    top1=top1, top5=min(1.0, top1 + 0.1)))
    # evaluation results (Tables C.2, C.3, D.1): robustness.csv, calibration.csv, multilabel.csv
    rob, cal, mul = [], [], []
    for o in OBJS:
        for s in SEEDS:
            st, r = _store(o, s), rank[o]
            for b in ("imagenet-v2", "imagenet-a", "imagenet-r", "imagenet-sketch"):
                rob.append(dict(store=st, objective=o, seed=s, benchmark=b, subset="", metric="top1",
                                value=0.3 + 0.01 * r + rng.normal(0, 0.003), n=50, classes=200, masked=True))
            rob.append(dict(store=st, objective=o, seed=s, benchmark="imagenet-c", subset="all 15 corruptions",
                            metric="mce", value=75 - r + rng.normal(0, 0.1), n="", classes="", masked=False))
            cal.append(dict(store=st, objective=o, seed=s, kind="softmax", nll=0.9 + 0.01 * r, ece=0.05 + 0.01 * r,
                            temperature=1.2, nll_ts=0.85, ece_ts=0.03 + rng.normal(0, 0.002), bins=15))
            for t in ("Edema", "Atelectasis"):
                mul.append(dict(store=st, objective=o, seed=s, task="xray", split="test", target=t, layer="pool",
                                auc=0.8 - 0.01 * r + rng.normal(0, 0.003), best_lambda=0.1, n=40, bins=1000))
    for name, rows in (("separation", sep), ("sparsity", spa), ("collapse", col), ("probes", pro), ("training", tra),
                       ("robustness", rob), ("calibration", cal), ("multilabel", mul)):
        pd.DataFrame(rows).to_csv(res / f"{name}.csv", index=False)
    # CKA: index over all (store, layer); same layer across nets ~1 early, lower late and across objectives
    index = [(_store(o, s), l) for o in OBJS for s in SEEDS for l in LAYERS]
    L = len(index)
    v = np.zeros((L, L))
    for i, (si, li) in enumerate(index):
        for j, (sj, lj) in enumerate(index):
            a, b = LAYERS.index(li), LAYERS.index(lj)
            oi, oj = si.split("-")[0], sj.split("-")[0]
            depth = max(a, b) / (len(LAYERS) - 1)
            v[i, j] = 1.0 if i == j else np.exp(-abs(a - b)) * (0.98 - (0.4 * depth if oi != oj else 0.1 * depth))
    v = (v + v.T) / 2
    np.savez(res / "cka_all.npz", values=v, stores=np.array([s for s, _ in index]),
             layers=np.array([l for _, l in index]),
             meta=json.dumps(dict(batch_size=64, epochs=2, debiased=True, spatial="flatten", seed=0)))
    spectra = {f"{_store(o, s)}/pool/{k}": np.sort(rng.gamma(2, 1, 16))[::-1] ** (1 + rank[o])
               for o in OBJS for s in SEEDS for k in ("activations", "weights", "centroids")}
    np.savez(res / "spectra.npz", **spectra)
    return res


EXPECTED_WITHOUT_STORES = {"fig1", "table1", "fig2a", "fig2b", "blocks", "fig3", "table3", "fig4", "fig5", "fig6",
                           "figC1", "figC2", "figC3", "tableC2", "tableC3", "figD1", "tableD1", "tableE1", "tableE2",
                           "figE2"}


def test_figures_from_results_only(tmp_path, capsys):
    res = write_results(tmp_path)
    out = tmp_path / "out"
    assert main(["figures", "--results", str(res), "--out", str(out), "--no-progress"]) == 0
    report = (out / "report.html").read_text()
    from repsim.analyses.items.catalog import ORDER

    for item in ORDER:
        kind_files = (f"{item}.png", f"{item}.pdf") if item.startswith("fig") else (f"{item}.csv", f"{item}.md")
        if item in EXPECTED_WITHOUT_STORES:
            for f in kind_files:
                assert (out / f).stat().st_size > 0, f
                assert f"href='{f}'" in report, f
        else:
            assert not (out / kind_files[0]).exists(), item
            assert re.search(rf"id='{item}' class='skipped'", report), item
    # every figure on disk is embedded in the report
    for png in out.glob("*.png"):
        assert f"<img src='{png.name}'" in report
    assert "class='failed'" not in report


def test_table1_takes_the_penultimate_layer_and_the_test_split_from_probes_of_several(tmp_path):
    """probes.csv keeps a probe of each layer and split (repsim.results.KEYS): Table 1 reads the pool
    layer's test-split rows, whatever else the file holds and in whatever order."""
    res = write_results(tmp_path)
    pro = pd.read_csv(res / "probes.csv").assign(layer="pool", split="test")
    other_layer = pro.assign(layer="block4", accuracy=0.11)
    other_split = pro.assign(split="holdout", accuracy=0.22)
    pd.concat([other_layer, pro, other_split]).to_csv(res / "probes.csv", index=False)
    out = tmp_path / "out"
    assert main(["figures", "--results", str(res), "--out", str(out), "--only", "table1", "--no-progress"]) == 0
    lin = pd.read_csv(out / "table1.csv").query("probe == 'linear'").set_index("objective")
    want = 100 * pro[(pro.probe == "linear") & (pro.task == "taskA") & (pro.objective == "sigmoid")].accuracy.mean()
    assert lin.loc["sigmoid", "taskA"] == pytest.approx(want)


def test_probe_reruns_on_another_layer_or_split_keep_both_rows(tmp_path):
    """`repsim probe` merges into probes.csv by store, task, probe, metric, layer and splits: probing a
    second layer, or the holdout split after the test split, adds rows instead of replacing them."""
    import repsim

    rng = np.random.default_rng(0)

    def store(name, split, n):
        y = np.arange(n) % 3
        layers = {"pool": rng.standard_normal((n, 6)) + y[:, None], "block1": rng.standard_normal((n, 4)) + y[:, None]}
        return repsim.save_store(str(tmp_path / f"{name}.zarr"), layers=layers, labels=y,
                                 meta={"dataset": {"name": "t", "split": split}, "model": {"objective": "softmax", "seed": 0}})

    tr, te, ho = store("tr", "train", 60), store("te", "test", 30), store("ho", "holdout", 30)
    out = tmp_path / "probes.csv"
    runs = [["--layer", "pool", "--test", te.path], ["--layer", "block1", "--test", te.path],
            ["--layer", "pool", "--test", ho.path], ["--layer", "pool", "--test", te.path]]  # the last one replaces the first
    for extra in runs:
        assert main(["probe", "--train", tr.path, "--probe", "knn", "--out", str(out), "--no-progress", *extra]) == 0
    got = pd.read_csv(out)
    assert sorted(zip(got["layer"], got["split"])) == [("block1", "test"), ("pool", "holdout"), ("pool", "test")]


def test_stores_of_equal_names_are_refused_not_merged(tmp_path, capsys):
    """Two networks' stores named alike in different directories (sm/tgt.zarr, cos/tgt.zarr): the results
    files name stores by their name, so `repsim figures` refuses (it averaged both as one objective's
    seeds), from the stores or, without them, from a results file giving one name two networks."""
    import repsim

    rng = np.random.default_rng(1)
    res = tmp_path / "results"
    res.mkdir()
    rows = []
    for o in ("softmax", "cosine_softmax"):
        x = rng.standard_normal((12, 4))
        repsim.save_store(str(tmp_path / "stores" / o / "tgt.zarr"), layers={"pool": x}, labels=np.arange(12) % 2,
                          meta={"dataset": {"name": "t", "split": "test"}, "model": {"objective": o, "seed": 0}})
        rows.append(dict(store="tgt", objective=o, seed=0, task="t", probe="knn", metric="top1", accuracy=0.5,
                         layer="pool", split="test"))
    pd.DataFrame(rows).to_csv(res / "probes.csv", index=False)
    assert main(["figures", "--stores", str(tmp_path / "stores"), "--results", str(res), "--out",
                 str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "both named 'tgt'" in err and "cos" in err and "softmax" in err and "\n" not in err.strip()
    assert main(["figures", "--results", str(res), "--out", str(tmp_path / "out2"), "--no-progress"]) == 2
    assert "probes.csv names store 'tgt' for several networks (softmax seed 0, cosine_softmax seed 0)" in capsys.readouterr().err


def test_fig2a_counts_pairs_of_networks_not_ordered_pairs(tmp_path):
    """Softmax vs. softmax with 2 seeds is 1 pair of distinct networks (its title said 2: both orders);
    softmax vs. another objective with 2 seeds each, 4; the control's mean block averages both orders."""
    from repsim.analyses.data import Inputs
    from repsim.analyses.items.layers import cka_groups, _mean_block

    inputs = Inputs(None, write_results(tmp_path))
    cka, groups, layers = cka_groups(inputs, "linear_cka")
    m, n = _mean_block(cka, groups["softmax"], groups["softmax"], layers, layers)
    a, b = groups["softmax"]
    assert n == 1 and np.allclose(m, (cka.block(a, b, layers, layers) + cka.block(b, a, layers, layers)) / 2)
    assert _mean_block(cka, groups["softmax"], groups["sigmoid"], layers, layers)[1] == 4


def test_table2_avg_note_names_its_actual_reason(tmp_path):
    """One seed per objective on two tasks: the Avg. note said the objectives' seed counts differ."""
    from repsim.analyses.data import Inputs
    from repsim.analyses.items.finetune import table2

    res = write_results(tmp_path)
    rows = [dict(store=f"{o}-s0-ft-{t}", objective=o, seed=0, task=t, accuracy=0.8 + 0.01 * i + 0.005 * j,
                 metric="top1") for i, o in enumerate(OBJS) for j, t in enumerate(("taskA", "taskB"))]
    pd.DataFrame(rows).to_csv(res / "finetune.csv", index=False)
    cap = table2(Inputs(None, res)).caption
    assert "seed counts differ" not in cap and "one seed per objective on two tasks" in cap


def test_tableC3_caption_names_the_columns_whose_cells_rest_on_one_seed(tmp_path):
    """A network whose T stopped at the search bound has blank TS columns: its objective's TS cells rest on
    one seed, which no t-test compares; the caption stated the t-test rule for every cell (stats audit)."""
    from repsim.analyses.data import Inputs
    from repsim.analyses.items.evaluation import tableC3
    from repsim.probes.calibration import TEMPERATURE_BOUNDS

    res = write_results(tmp_path)
    assert "rest on one seed" not in tableC3(Inputs(None, res)).caption
    cal = pd.read_csv(res / "calibration.csv")
    cal.loc[(cal.objective == "softmax") & (cal.seed == 1), "temperature"] = TEMPERATURE_BOUNDS[0]
    cal.to_csv(res / "calibration.csv", index=False)
    t = tableC3(Inputs(None, res))
    assert "In NLL (TS), ECE (TS) some cells rest on one seed" in t.caption
    assert t.numeric.loc[t.numeric.objective == "softmax", "NLL (TS) n"].item() == 1


def test_table1_bold_rule_and_values(tmp_path):
    res = write_results(tmp_path)
    out = tmp_path / "out"
    assert main(["figures", "--results", str(res), "--out", str(out), "--only", "table1", "--no-progress"]) == 0
    num = pd.read_csv(out / "table1.csv")
    lin = num[num["probe"] == "linear"].set_index("objective")
    # means recomputed from the CSV input, in %
    pro = pd.read_csv(res / "probes.csv")
    want = 100 * pro[(pro.probe == "linear") & (pro.task == "taskA") & (pro.objective == "sigmoid")].accuracy.mean()
    assert lin.loc["sigmoid", "taskA"] == pytest.approx(want)
    md = (out / "table1.md").read_text()
    # softmax is best by construction (0.9 vs 0.85 with sd 0.004): its cell is bold, squared error's is not
    soft = next(l for l in md.splitlines() if l.startswith("| linear | Softmax"))
    sq = next(l for l in md.splitlines() if l.startswith("| linear | Squared error"))
    header = next(l for l in md.splitlines() if l.startswith("| Probe")).split("|")
    col = header.index(" taskA ")
    assert soft.split("|")[col].strip().startswith("**")
    assert not sq.split("|")[col].strip().startswith("**")
    assert "**" not in soft.split("|")[header.index(" R² ")]  # R² is descriptive, never bold


def test_fig5_spearman_in_caption(tmp_path):
    res = write_results(tmp_path)
    out = tmp_path / "out"
    assert main(["figures", "--results", str(res), "--out", str(out), "--only", "fig5", "--no-progress"]) == 0
    report = (out / "report.html").read_text()
    # R² rises and transfer falls with rank: perfect negative rank correlation over 4 objectives
    assert "ρ = -1.000" in report


def test_figure_formats(tmp_path, capsys):
    """--formats: the figure files asked for (default PNG + PDF); the report embeds the PNG, else the SVG,
    and a PDF alone is only linked; a format matplotlib is not asked to write here is refused in one line."""
    res = write_results(tmp_path)
    for formats, files, shown in ((None, {"fig5.png", "fig5.pdf"}, "fig5.png"),
                                  (["svg", ".PNG"], {"fig5.png", "fig5.svg"}, "fig5.png"),
                                  (["svg"], {"fig5.svg"}, "fig5.svg"), (["pdf"], {"fig5.pdf"}, None)):
        out = tmp_path / f"out-{formats}"
        argv = ["figures", "--results", str(res), "--out", str(out), "--only", "fig5", "--no-progress"]
        assert main(argv + (["--formats", *formats] if formats else [])) == 0
        assert {f.name for f in out.glob("fig5.*")} == files
        report = (out / "report.html").read_text()
        assert ("<img src='%s'" % shown in report) if shown else ("<img " not in report and "href='fig5.pdf'" in report)
    assert (tmp_path / "out-['svg']" / "fig5.svg").read_text().lstrip().startswith("<?xml")
    capsys.readouterr()
    assert main(["figures", "--results", str(res), "--out", str(tmp_path / "bad"), "--formats", "png", "jpg"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--formats: jpg is not a figure format; choose from png, pdf, svg" in err[0], err


def test_missing_inputs_are_skipped_with_a_note(tmp_path):
    res = tmp_path / "empty"
    res.mkdir()
    out = tmp_path / "out"
    assert main(["figures", "--results", str(res), "--out", str(out), "--no-progress"]) == 0
    report = (out / "report.html").read_text()
    assert "probes.csv not found in --results" in report
    assert "no results file of repsim cka or repsim similarity in --results" in report
    assert not list(out.glob("*.png"))


def test_partial_inputs(tmp_path):
    res = write_results(tmp_path)
    (res / "training.csv").unlink()
    out = tmp_path / "out"
    assert main(["figures", "--results", str(res), "--out", str(out), "--no-progress", "--only", "fig1", "table1"]) == 0
    assert not (out / "fig1.png").exists() and (out / "table1.csv").exists()
    md = (out / "table1.md").read_text()
    assert "source accuracy omitted (training.csv not found" in md


def test_modal_breaks_ties_by_confidence():
    from repsim.analyses.items.predictions import modal

    pred = np.array([[0, 1, 1, 2], [0, 2, 1, 1], [0, 2, 0, 0]])
    conf = np.array([[0.9] * 4, [0.6] * 4, [0.5] * 4])
    # examples 1, 2: two votes beat one whatever the confidence; example 3: a three-way tie, network 0 is surest
    assert modal(pred, conf, 3).tolist() == [0, 2, 1, 2]
    two = modal(pred[:2], conf[:2], 3)  # 1 vs 1 ties: the more confident voter (network 0) wins
    assert two.tolist() == [0, 1, 1, 2]
    assert modal(pred[:2], conf[:2], 3, rows=1).tolist() == two.tolist()  # row chunking changes nothing



def test_findings_on_synthetic_results(tmp_path):
    from repsim.analyses.data import Inputs
    from repsim.analyses.findings import evaluate

    res = write_results(tmp_path)
    f = {x.name: x for x in evaluate(Inputs(None, res))}
    # built in: source accuracy rises with rank while transfer falls; R² rises; late-layer CKA gap only
    t = f["Better objectives transfer worse"]
    assert t.verdict == "reproduced" and "3 of 3 objectives beat softmax on source accuracy, 3 of them" in t.evidence
    assert "Spearman ρ(source top-1, transfer) = -1.00" in t.evidence
    late = f["Objectives differ only in late blocks"]
    assert late.verdict == "partial"  # synthetic gap is 0.3*depth: early gap 0.075 > 0.02
    s = f["Class separation rises and predicts worse transfer"]
    # ρ(R², transfer) = −1 over 4 objectives: its exact permutation p is 2/4! = 0.083 (the t approximation
    # said 0), so no ρ reaches p < 0.05 and only (a) holds
    assert s.verdict == "partial" and "3 of 3 objectives" in s.evidence
    assert "ρ(R², mean linear transfer) = -1.00 (p = 0.0833" in s.evidence
    assert "no ρ reaches p < 0.05 with 4 objectives (exact permutation p)" in s.why


def test_findings_not_evaluated_without_inputs(tmp_path):
    from repsim.analyses.data import Inputs
    from repsim.analyses.findings import evaluate

    assert {x.verdict for x in evaluate(Inputs(None, tmp_path))} == {"not evaluated"}


def test_findings_detect_a_contradiction(tmp_path):
    from repsim.analyses.data import Inputs
    from repsim.analyses.findings import evaluate

    res = write_results(tmp_path)
    pro = pd.read_csv(res / "probes.csv")
    pro.loc[pro.objective == "squared_error", "accuracy"] += 0.2  # now the best-transferring objective
    pro.to_csv(res / "probes.csv", index=False)
    f = {x.name: x for x in evaluate(Inputs(None, res))}
    assert f["Better objectives transfer worse"].verdict == "not reproduced"
    ev = f["Better objectives transfer worse"].evidence  # the best's p is against softmax, and says so
    assert re.search(r"best transfer \S.*?\(\d+\.\d ± \d+\.\d%, p = \S+ vs softmax\)", ev), ev
    # R² still rises for every objective, but no longer predicts worse transfer: one of two holds
    assert f["Class separation rises and predicts worse transfer"].verdict == "partial"


def test_transfer_evidence_lists_worse_and_better_transfer_apart(tmp_path):
    """Finding 1: of the objectives above softmax on source accuracy, those after "transfer worse" are
    the ones below softmax's transfer; one that transfers better is listed under "transfer better"."""
    from repsim.analyses.data import Inputs, display
    from repsim.analyses.findings import evaluate

    res = write_results(tmp_path)
    pro = pd.read_csv(res / "probes.csv")
    pro.loc[(pro.objective == OBJS[1]) & (pro.task != "source"), "accuracy"] += 0.2  # beats softmax, transfers better
    pro.to_csv(res / "probes.csv", index=False)
    ev = {x.name: x for x in evaluate(Inputs(None, res))}["Better objectives transfer worse"].evidence
    m = re.search(r"3 of 3 objectives beat softmax on source accuracy, 2 of them transfer worse \((.*?)\), "
                  r"1 transfer better \((.*?)\) \(p: Student's t-test vs softmax\)\.", ev)
    assert m, ev
    worse, better = m.groups()
    assert display(OBJS[2]) in worse and display(OBJS[3]) in worse and display(OBJS[1]) not in worse
    assert better.startswith(display(OBJS[1]) + " source") and display(OBJS[2]) not in better


def test_separation_evidence_ranges_only_the_higher_objectives(tmp_path):
    """Finding 3 lists the objectives not above softmax, and the range it gives is of the others only."""
    from repsim.analyses.data import Inputs
    from repsim.analyses.findings import evaluate

    res = write_results(tmp_path)
    sep = pd.read_csv(res / "separation.csv")
    sep.loc[sep.objective == OBJS[-1], "r2"] = 0.01  # the most separated objective now lies below softmax
    sep.to_csv(res / "separation.csv", index=False)
    ev = {x.name: x for x in evaluate(Inputs(None, res))}["Class separation rises and predicts worse transfer"].evidence
    assert "not higher:" in ev and "0.010" in ev.split("not higher:")[1].split(";")[0]
    low, high = (float(v) for v in re.search(r"; higher: (\d\.\d+)–(\d\.\d+)", ev).groups())
    assert low > 0.01 and "others" not in ev


def test_cka_objectives_from_engine_provenance(tmp_path):
    """Without stores or CSVs, Fig. 2 takes each store's objective from CKAResult.meta["stores"]."""
    src = write_results(tmp_path)
    res = tmp_path / "only_cka"
    res.mkdir()
    with np.load(src / "cka_all.npz") as z:
        stores = z["stores"]
        meta = json.loads(str(z["meta"]))
        meta["stores"] = {s: {"path": f"/x/{s}.zarr", "attrs": {"model": {"objective": s.split("-")[0],
                                                                           "seed": int(s.split("-s")[1][0])}}}
                          for s in dict.fromkeys(stores.tolist())}
        np.savez(res / "cka_x.npz", values=z["values"], stores=stores, layers=z["layers"], meta=json.dumps(meta))
    out = tmp_path / "out"
    assert main(["figures", "--results", str(res), "--out", str(out), "--no-progress", "--only", "fig2a", "fig2b"]) == 0
    assert (out / "fig2a.png").exists() and (out / "fig2b.png").exists()
    assert "4 objectives, 8 stores, seeds 0, 1" in (out / "report.html").read_text()


def test_fig2a_caption_names_its_stores(tmp_path):
    """Fig. 2a describes the stores it averaged (it once passed its matplotlib axes instead: a caption
    of 'data: not recorded' under pandas 2, ArrowInvalid under pandas 3 with pyarrow); describe() takes
    store names only."""
    from repsim.analyses.data import Inputs
    from repsim.analyses.items.layers import fig2a

    inputs = Inputs(None, write_results(tmp_path))
    fig = fig2a(inputs)
    assert "objectives, 8 stores, seeds 0, 1" in fig.caption, fig.caption
    fig.fig.clf()
    with pytest.raises(TypeError, match="store names"):
        inputs.describe([object()])


def test_blocks_consecutive_cka_on_planted_numbers(tmp_path):
    """The consecutive-block table reads each store against itself: write_results plants, within one network,
    CKA(layer a, layer a+1) = e⁻¹ · (0.98 − 0.1 · (a+1)/4); a second file plants one network whose blocks 2 → 3
    are identical (1.0). Without stores there are no stage boundaries: the summary spans every block → block
    transition (pool excluded)."""
    from repsim.analyses.data import Inputs
    from repsim.analyses.items.layers import blocks

    res = write_results(tmp_path)
    t = blocks(Inputs(None, res))
    num = t.numeric.set_index("objective")
    want = [np.exp(-1) * (0.98 - 0.1 * (a + 1) / 4) for a in range(4)]
    for col, w in zip(["1→2", "2→3", "3→4", "4→pool"], want):
        assert num.loc["softmax", col] == pytest.approx(w)
        assert num.loc["cosine_softmax", f"{col} n"] == 2
    assert num.loc["sigmoid", "median within stages"] == pytest.approx(want[1])  # of 1→2, 2→3, 3→4
    assert num.loc["sigmoid", "≥ 0.999"] == 0
    assert "of 3" in t.caption and "no store to read stage boundaries" in t.caption
    assert list(t.shown.columns)[:2] == ["Objective", "1→2"]

    # one network with identical blocks 2 and 3: counted, and its median moves
    with np.load(res / "cka_all.npz") as z:
        v, stores, layers, meta = z["values"].copy(), z["stores"], z["layers"], z["meta"]
    i = [k for k, (s, l) in enumerate(zip(stores, layers)) if s == "softmax-s0-test" and l in ("block2", "block3")]
    v[i[0], i[1]] = v[i[1], i[0]] = 1.0
    np.savez(res / "cka_all.npz", values=v, stores=stores, layers=layers, meta=meta)
    num = blocks(Inputs(None, res)).numeric.set_index("objective")
    assert num.loc["softmax", "≥ 0.999"] == pytest.approx(0.5)  # 1 of 2 seeds
    assert num.loc["softmax", "2→3"] == pytest.approx((1.0 + want[1]) / 2)


def test_kde_bandwidths():
    """Fig. E.1's kernel: the paper's 5e-6 for 1,000 classes (rescaled by 1000/K); the density by its definition."""
    from repsim.analyses.items.predictions import avh_bandwidth, kde_density

    assert avh_bandwidth(1000) == 5e-6 and avh_bandwidth(5) == pytest.approx(1e-3)
    v = np.array([0.10, 0.11, 0.13, 0.20])
    xs = np.linspace(0.05, 0.25, 7)
    h = 0.01
    ref = np.mean(np.exp(-0.5 * ((xs[:, None] - v[None]) / h) ** 2) / (h * np.sqrt(2 * np.pi)), axis=1)
    np.testing.assert_allclose(kde_density(v, xs, h), ref, rtol=1e-10)
    scott = np.std(v, ddof=1) * len(v) ** -0.2            # Scott's rule when no bandwidth is given
    np.testing.assert_allclose(kde_density(v, xs), kde_density(v, xs, scott), rtol=1e-10)


def test_tableC3_leaves_out_temperatures_at_the_search_bound(tmp_path):
    """A T stopped at the search bound (0.01: a perfectly classified holdout) is no calibrated
    temperature: that network's NLL (TS) / ECE (TS) are blank, and the caption says why."""
    from repsim.analyses.data import Inputs
    from repsim.analyses.items.evaluation import tableC3

    res = write_results(tmp_path)
    cal = pd.read_csv(res / "calibration.csv")
    hit = cal.objective == OBJS[1]
    cal.loc[hit, "temperature"] = 0.0100001
    cal.loc[hit, "nll_ts"] = 57.0  # what temperature scaling at the bound gives: not a result
    cal["holdout_top1"] = np.where(hit, 1.0, 0.97)
    cal.to_csv(res / "calibration.csv", index=False)
    t = tableC3(Inputs(None, res))
    from repsim.analyses.data import display

    row = t.shown.set_index("Objective").loc[display(OBJS[1])]
    assert row["NLL (TS)"] == "–" and row["ECE (TS)"] == "–"
    assert "57" not in t.shown.to_string()
    assert f"for {int(hit.sum())} of {len(cal)} networks T stopped at the search bound" in t.caption
    assert "classify their holdout perfectly" in t.caption


def test_tableC3_leaves_out_fits_one_grid_step_from_the_bound_and_their_T(tmp_path):
    """A perfect holdout's NLL ties at 0 near T = 0.01, so the fit can land on the grid point after the
    bound (0.0126): as degenerate as the bound itself, it is blank too, at either end, and no blanked T
    enters the T column. A fit well inside the range with a perfect holdout (sigmoid, T = 0.29) stays."""
    from repsim.analyses.data import Inputs, display
    from repsim.analyses.items.evaluation import tableC3
    from repsim.probes.calibration import TEMPERATURE_BOUNDS, temperature_grid_step

    res = write_results(tmp_path)
    cal = pd.read_csv(res / "calibration.csv")
    step = np.exp(temperature_grid_step())
    cal["holdout_top1"] = 0.97
    first = (cal.objective == OBJS[0]) & (cal.seed == 0)   # one grid step above the lower bound
    cal.loc[first, ["temperature", "nll_ts", "ece_ts", "holdout_top1"]] = [TEMPERATURE_BOUNDS[0] * step, 3.52, 0.004, 1.0]
    top = (cal.objective == OBJS[3]) & (cal.seed == 1)     # one grid step below the upper bound
    cal.loc[top, ["temperature", "nll_ts"]] = [TEMPERATURE_BOUNDS[1] / step, 7.77]
    sig = (cal.objective == OBJS[1]) & (cal.seed == 1)     # perfect holdout, T inside: a calibration
    cal.loc[sig, ["temperature", "holdout_top1"]] = [0.29, 1.0]
    cal.to_csv(res / "calibration.csv", index=False)
    t = tableC3(Inputs(None, res))
    shown = t.shown.set_index("Objective")
    assert shown.loc[display(OBJS[0]), "NLL (TS)"] == "0.850"       # the other seed's alone
    assert shown.loc[display(OBJS[0]), "T"] == "1.200"              # 0.0126 not averaged in
    assert shown.loc[display(OBJS[3]), "T"] == "1.200"
    assert "3.52" not in t.shown.to_string() and "7.77" not in t.shown.to_string()
    assert shown.loc[display(OBJS[1]), "T"].startswith("0.745")     # mean of 1.2 and 0.29: kept
    assert "for 2 of 8 networks T stopped at the search bound" in t.caption
    assert "their T, NLL (TS) and ECE (TS) are left out" in t.caption


def _split_separation(res, train_layers):
    """separation.csv of every layer on the test split and ``train_layers`` on the training split; the
    training split's R² higher by 0.1, so that the figure's split shows in its values."""
    rows = []
    for o in OBJS:
        for s in SEEDS:
            for split, layers, shift in (("test", LAYERS, 0.0), ("train", train_layers, 0.1)):
                for li, layer in enumerate(LAYERS):
                    if layer in layers:
                        rows.append(dict(store=f"{o}-s{s}-{split}", objective=o, seed=s, layer=layer, distance="cosine",
                                         r2=0.1 + 0.1 * li + shift, dataset="digits-source", split=split,
                                         n=586 if split == "train" else 225))
    pd.DataFrame(rows).to_csv(res / "separation.csv", index=False)


def test_fig4_is_on_the_training_split_when_it_has_every_layer(tmp_path):
    """The paper's Fig. 4 is on the training set, as Table 3: with every layer of both splits the
    figure draws the training split, so that its last point is Table 3's R²."""
    from repsim.analyses.data import Inputs
    from repsim.analyses.items.layers import fig4, table3

    res = write_results(tmp_path)
    _split_separation(res, LAYERS)
    out = fig4(Inputs(None, res))
    assert "digits-source/train (n=586)" in out.caption and "digits-source/test" not in out.caption
    assert "not the training set" not in out.caption
    last = max(line.get_ydata()[-1] for line in out.fig.axes[0].get_lines() if len(line.get_ydata()) == len(LAYERS))
    t3 = table3(Inputs(None, res)).numeric
    assert last == pytest.approx(t3.filter(like="R²").iloc[:, 0].max())


def test_fig4_on_the_test_split_says_so(tmp_path):
    """With the training split at the penultimate layer only, Fig. 4 falls back to the test split and
    its caption says it is not the paper's training set and that its last point is not Table 3's."""
    from repsim.analyses.data import Inputs
    from repsim.analyses.items.layers import fig4

    res = write_results(tmp_path)
    _split_separation(res, ["pool"])
    cap = fig4(Inputs(None, res)).caption
    assert "digits-source/test (n=225)" in cap
    assert "Drawn on the test split, not the training set of the paper's Fig. 4" in cap
    assert "its last point is not Table 3's R²" in cap


def test_fig6_original_dots_stay_visible_under_equal_relearned_ones(tmp_path):
    """Fig. 6: where the original head and the relearned probe score alike, both markers show: the blue
    ones are hollow rings drawn above the filled orange dots, and the legend names each."""
    from matplotlib.colors import to_rgba

    from repsim.analyses.data import Inputs
    from repsim.analyses.items.transfer import fig6

    res = write_results(tmp_path)
    pro = pd.read_csv(res / "probes.csv")
    src = pro[(pro.task == "source") & (pro.probe == "linear")]
    pro = pd.concat([pro, src.assign(probe="original_head")])  # the same accuracy as the relearned probe
    pro.to_csv(res / "probes.csv", index=False)
    ax = fig6(Inputs(None, res)).fig.axes[0]
    colls = {c.get_label(): c for c in ax.collections}
    blue, orange = colls["original classifier"], colls["relearned linear classifier"]
    np.testing.assert_allclose(blue.get_offsets(), orange.get_offsets())
    assert blue.get_zorder() > orange.get_zorder()
    assert len(blue.get_facecolors()) == 0 or blue.get_facecolors()[:, 3].max() == 0  # hollow
    assert tuple(blue.get_edgecolors()[0]) == to_rgba("#1f77b4")
    assert blue.get_sizes()[0] > orange.get_sizes()[0]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert sorted(legend) == ["original classifier", "relearned linear classifier"]


def test_training_curves_say_where_they_end(tmp_path):
    from repsim.analyses.data import Inputs
    from repsim.analyses.items.training import figC1, figC2, figC3

    res = write_results(tmp_path)
    for fn in (figC1, figC2, figC3):
        assert "ends at the network's analysed checkpoint — the epoch of best.pt" in fn(Inputs(None, res)).caption


def test_point_labels_do_not_overlap():
    """Objectives with nearly equal coordinates (Fig. 6) get labels that do not overprint each other."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from repsim.analyses.items.common import label_points

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    pts = [(0.770, 99.0), (0.778, 99.0), (0.772, 99.0), (0.60, 97.0)]
    ax.scatter(*zip(*pts))
    ax.margins(0.2)
    label_points(ax, pts, ["Logit normalization", "Sigmoid", "Cosine softmax", "Softmax"])
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    boxes = [t.get_window_extent(r) for t in ax.texts]
    assert len(boxes) == 4
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    plt.close(fig)


def test_point_labels_stay_inside_the_axes():
    """Fig. 6's rightmost point ("Squared error") was labelled to its right, past the axes and under the
    legend placed beside them; a label goes to the left of a point at the right edge."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from repsim.analyses.items.common import label_points, legend_outside

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    pts = [(0.60, 97.0), (0.70, 98.0), (0.80, 98.5)]
    ax.scatter(*zip(*pts), label="dots")
    legend_outside(ax)
    ax.margins(x=0.05, y=0.1)
    label_points(ax, pts, ["Softmax", "Sigmoid", "Squared error"])
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    frame = ax.get_window_extent(r)
    for t in ax.texts:
        box = t.get_window_extent(r)
        assert frame.x0 <= box.x0 and box.x1 <= frame.x1, (t.get_text(), box, frame)
    plt.close(fig)


def test_spectra_figure_counts_with_integer_ticks(tmp_path):
    from repsim.analyses.data import Inputs
    from repsim.analyses.items.predictions import figE2

    res = write_results(tmp_path)
    fig = figE2(Inputs(None, res)).fig
    fig.canvas.draw()
    for ax in fig.axes:
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks


def test_heatmap_labels_each_objective_once():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from repsim.analyses.items.predictions import _heatmap

    fig, ax = plt.subplots()
    groups = ["Softmax", "Softmax", "Sigmoid", "Sigmoid", "Dropout", "Dropout"]
    _heatmap(ax, np.random.default_rng(0).uniform(size=(6, 6)), [f"{g} s{i % 2}" for i, g in enumerate(groups)],
             "t", groups=groups)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["Softmax", "Sigmoid", "Dropout"]
    assert list(ax.get_yticks()) == [0.5, 2.5, 4.5]
    plt.close(fig)
