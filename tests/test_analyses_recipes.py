"""Items of the training half of issue 17 on small synthetic results files and real stores: Table 2 (with
its two-way ANOVA), Fig. D.3, Tables C.1, C.4, C.5, C.6, E.3; which stores the end-of-training items see."""
from __future__ import annotations


import numpy as np
import pandas as pd
import pytest
from scipy import stats

from repsim import linear_cka, save_store
from repsim.commands.main import main
from repsim.probes.stats import anova_two_way, not_significantly_worse_anova


# -- the two-way ANOVA -----------------------------------------------------------------------------
def _ols_rss(y, X):
    beta, *_ = np.linalg.lstsq(X, y, rcond=None)
    return float(((y - X @ beta) ** 2).sum())


def _anova_by_regression(a, b, interaction=True):
    """F and p of the group effect by model comparison with effect (sum-to-zero) coding: brute force."""
    n, T = a.shape
    y = np.concatenate([a.ravel(), b.ravel()])
    g = np.repeat([1.0, -1.0], n * T)
    task = np.tile(np.arange(T), 2 * n)
    tcols = np.stack([(task == t).astype(float) - (task == T - 1) for t in range(T - 1)], 1) if T > 1 else np.zeros((len(y), 0))
    inter = tcols * g[:, None] if interaction else np.zeros((len(y), 0))
    one = np.ones((len(y), 1))
    full = np.hstack([one, g[:, None], tcols, inter])
    reduced = np.hstack([one, tcols, inter])
    rss_full = _ols_rss(y, full)
    df = len(y) - np.linalg.matrix_rank(full)
    F = (_ols_rss(y, reduced) - rss_full) / (rss_full / df)
    return F, stats.f.sf(F, 1, df)


@pytest.mark.parametrize("n,T", [(3, 4), (2, 8), (1, 5)])
def test_anova_two_way_matches_regression(n, T):
    rng = np.random.default_rng(n * 10 + T)
    a = rng.normal(size=(n, T)) + np.arange(T)
    b = rng.normal(0.7, size=(n, T)) + np.arange(T)
    F, p = anova_two_way(a, b)
    Fr, pr = _anova_by_regression(a, b, interaction=n > 1)
    assert F == pytest.approx(Fr, rel=1e-9) and p == pytest.approx(pr, rel=1e-9)


def test_anova_with_one_task_is_the_t_test():
    rng = np.random.default_rng(3)
    a, b = rng.normal(size=(4, 1)), rng.normal(1, size=(4, 1))
    r = stats.ttest_ind(a[:, 0], b[:, 0])
    F, p = anova_two_way(a, b)
    assert F == pytest.approx(r.statistic**2) and p == pytest.approx(r.pvalue)
    assert not_significantly_worse_anova({"x": a, "y": b + 10}) == {"y"}
    with pytest.raises(ValueError, match="equal"):
        anova_two_way(a, b[:2])


# -- Table 2 ---------------------------------------------------------------------------------------
def _finetune_csv(res, rng):
    rows = []
    base = {"softmax": 90.0, "sigmoid": 89.9, "squared_error": 85.0}
    for o, acc in base.items():
        for s in range(3):
            for ti, task in enumerate(("food", "pets")):
                rows.append(dict(objective=o, params="{}", variant="", seed=s, task=task,
                                 metric="mean_per_class" if task == "pets" else "top1",
                                 accuracy=acc - 3 * ti + rng.normal(0, 0.3), lr=0.01, weight_decay=1e-5,
                                 steps=20000, grid_points=72, source_checkpoint=f"/r/{o}-s{s}/best.pt"))
    pd.DataFrame(rows).to_csv(res / "finetune.csv", index=False)
    return pd.DataFrame(rows)


def test_table2_means_and_anova_bold(tmp_path):
    res = tmp_path / "results"
    res.mkdir()
    df = _finetune_csv(res, np.random.default_rng(0))
    out = tmp_path / "out"
    assert main(["figures", "--results", str(res), "--out", str(out), "--no-progress", "--only", "table2"]) == 0
    num = pd.read_csv(out / "table2.csv").set_index("objective")
    for o in ("softmax", "sigmoid", "squared_error"):
        sub = df[df.objective == o]
        assert num.loc[o, "food"] == pytest.approx(sub[sub.task == "food"].accuracy.mean())
        assert num.loc[o, "Avg."] == pytest.approx(sub.groupby("seed").accuracy.mean().mean())
    md = (out / "table2.md").read_text()
    # softmax best; sigmoid is 0.1 behind (not significant), squared error 5 behind (significant)
    wide = {o: df[df.objective == o].pivot(index="seed", columns="task", values="accuracy").to_numpy()
            for o in ("softmax", "sigmoid", "squared_error")}
    assert anova_two_way(wide["sigmoid"], wide["softmax"])[1] > 0.05 > anova_two_way(wide["squared_error"], wide["softmax"])[1]
    lines = {l.split("|")[1].strip(): l for l in md.splitlines() if l.startswith("| ")}
    assert lines["Softmax"].rstrip(" |").split("|")[-1].strip().startswith("**")
    assert lines["Sigmoid"].rstrip(" |").split("|")[-1].strip().startswith("**")
    assert not lines["Squared error"].rstrip(" |").split("|")[-1].strip().startswith("**")
    assert "two-way ANOVA" in md and "pets: mean_per_class" in md


# -- Fig. D.3 and which stores the items see ---------------------------------------------------------
def _ft_stores(root):
    rng = np.random.default_rng(5)
    d = root / "stores"
    N = 80
    y = np.arange(N) % 4
    arrays = {}
    for s in (0, 1):
        sha = f"{s:064x}"
        pre = {l: np.abs(rng.normal(size=(N, 6))).astype(np.float32) for l in ("block1", "block2", "pool")}
        # fine-tuning: early layers barely move, later ones more
        post = {l: (pre[l] + scale * np.abs(rng.normal(size=(N, 6)))).astype(np.float32)
                for l, scale in (("block1", 0.05), ("block2", 0.5), ("pool", 2.0))}
        arrays[s] = (pre, post)
        common = {"dataset": {"name": "target", "split": "test"}}
        save_store(d / f"pre-s{s}.zarr", pre, y, logits=rng.normal(size=(N, 4)).astype(np.float32),
                   meta={**common, "model": {"objective": "softmax", "seed": s, "epoch": 9, "checkpoint_sha256": sha}})
        save_store(d / f"post-s{s}.zarr", post, y, logits=rng.normal(size=(N, 4)).astype(np.float32),
                   meta={**common, "model": {"objective": "softmax", "seed": s, "epoch": 3, "checkpoint_sha256": "f" * 64,
                                             "finetuned_from": {"sha256": sha, "objective": "softmax", "seed": s}}})
        # an earlier checkpoint of the pretrained network (training dynamics)
        save_store(d / f"pre-s{s}-e2.zarr", pre, y, logits=rng.normal(size=(N, 4)).astype(np.float32),
                   meta={**common, "model": {"objective": "softmax", "seed": s, "epoch": 2, "checkpoint_sha256": "e" * 64}})
    return d, arrays


def test_figD3_pairs_and_store_selection(tmp_path):
    stores, arrays = _ft_stores(tmp_path)
    res = tmp_path / "results"
    res.mkdir()
    paths = [str(stores / f"{k}-s{s}.zarr") for s in (0, 1) for k in ("pre", "post")]
    assert main(["cka", *paths, "--method", "exact", "--out", str(res / "cka_ft.npz"), "--no-progress"]) == 0
    from repsim.analyses.data import Inputs
    from repsim.analyses.items.finetune import _finetune_pairs

    inputs = Inputs(stores, res)
    assert sorted(inputs.stores) == ["pre-s0", "pre-s1"]  # not fine-tuned, not the epoch-2 checkpoints
    assert len(inputs.all_stores) == 6
    pairs = _finetune_pairs(inputs)
    assert sorted((p["source"], p["tuned"]) for p in pairs) == [("pre-s0", "post-s0"), ("pre-s1", "post-s1")]
    for p in pairs:
        pre, post = arrays[int(p["seed"])]
        ref = [linear_cka(pre[l].astype(np.float64), post[l].astype(np.float64), debiased=True) for l in p["layers"]]
        assert p["layers"] == ["block1", "block2", "pool"]
        assert np.allclose(p["cka"], ref, atol=2e-3)  # float16 layers in the store
        assert p["cka"][0] > p["cka"][2]
    out = tmp_path / "out"
    assert main(["figures", "--stores", str(stores), "--results", str(res), "--out", str(out), "--no-progress",
                 "--only", "figD3", "fig2a"]) == 0
    assert (out / "figD3.png").exists() and (out / "figD3.pdf").exists()
    report = (out / "report.html").read_text()
    # Fig. 2a sees only the pretrained (final) stores: one softmax pair needs 2 distinct networks in one file,
    # and the fine-tuned stores are not counted as a second objective
    assert "id='fig2a'" in report and "post-s0" not in report[report.find("id='fig2a'"):][:2000]


# -- Tables C.1, C.4, C.5, C.6, E.3 ------------------------------------------------------------------
def _training_rows(objective, seed, variant="", params="{}", acc=80.0, epochs=3, decay=0.975):
    rows = []
    for e in range(1, epochs + 1):
        for split, a in (("train", acc + 5), ("holdout", acc + e), ("test", acc + e - 1)):
            rows.append(dict(store=f"{objective}-{variant}-s{seed}", objective=objective, params=params, variant=variant,
                             seed=seed, epoch=e, split=split, top1=a, top5=a + 10, schedule_decay=decay))
    return rows


def test_recipe_tables(tmp_path):
    res = tmp_path / "results"
    res.mkdir()
    rng = np.random.default_rng(2)
    rows = []
    for s in (0, 1, 2):
        j = rng.normal(0, 0.1)
        rows += _training_rows("softmax", s, acc=76 + j)
        rows += _training_rows("sigmoid", s, acc=77 + j)
        rows += _training_rows("softmax", s, "autoaugment", acc=77 + j)
        rows += _training_rows("sigmoid", s, "autoaugment", acc=78 + j)
        rows += _training_rows("softmax", s, "mixup", acc=78 + j)
        rows += _training_rows("sigmoid", s, "autoaugment+decay0.985", acc=79 + j, epochs=5, decay=0.985)
        rows += _training_rows("sigmoid", s, "autoaugment+mixup+decay0.985", acc=80 + j, epochs=4, decay=0.985)
        rows += _training_rows("dropout", s, params='{"keep_prob": 0.7}', acc=77.5 + j)
        rows += _training_rows("sigmoid+dropout", s, params='{"keep_prob": 0.7}', acc=77.6 + j)
        rows += _training_rows("cosine_softmax+sigmoid", s, params='{"tau": 0.05}', acc=75 + j)
        rows += _training_rows("label_smoothing+logit_norm", s, params='{"alpha": 0.1, "tau": 0.04}', acc=77.7 + j)
    pd.DataFrame(rows).to_csv(res / "training.csv", index=False)
    sep = [dict(store=f"{o}-{v}-s{s}", objective=o, variant=v, seed=s, layer="pool", distance="cosine",
                r2=r2 + 0.001 * s) for s in (0, 1, 2) for o, v, r2 in
           (("softmax", "", 0.35), ("softmax", "autoaugment", 0.353), ("sigmoid", "", 0.43), ("sigmoid", "autoaugment", 0.432))]
    pd.DataFrame(sep).to_csv(res / "separation.csv", index=False)
    acc = [dict(store=f"{o}-s{s}-train", objective=o, seed=s, epoch=3, dataset="src", split=sp, n=100,
                top1=t - 0.01 * s + (0.1 if sp == "test" else 0), top5=0.99, mean_per_class=t)
           for o, t in (("softmax", 0.936), ("sigmoid", 0.932)) for s in (0, 1) for sp in ("train", "test")]
    pd.DataFrame(acc).to_csv(res / "accuracy.csv", index=False)
    out = tmp_path / "out"
    assert main(["figures", "--results", str(res), "--out", str(out), "--no-progress",
                 "--only", "tableC1", "tableC4", "tableC5", "tableC6", "tableE3"]) == 0, (out / "report.html").read_text()

    c1 = pd.read_csv(out / "tableC1.csv").set_index("objective")
    assert c1.loc["softmax", "Top-1 (%)"] == pytest.approx(100 * (0.936 - 0.005))
    assert c1.loc["sigmoid", "Top-5 (%)"] == pytest.approx(99.0)

    c4 = pd.read_csv(out / "tableC4.csv").set_index("combined with")
    # the highest holdout top-1 during training (epoch 3: acc + 3), mean over seeds
    tr = pd.DataFrame(rows)
    best = lambda o, v="": tr[(tr.objective == o) & (tr.variant == v) & (tr.split == "holdout")].groupby("seed").top1.max().mean()
    assert c4.loc["Dropout (keep_prob=0.7)", "Sigmoid"] == pytest.approx(best("sigmoid+dropout"))
    assert c4.loc["Dropout (keep_prob=0.7)", "Baseline"] == pytest.approx(best("dropout"))
    assert c4.loc["Cosine softmax (tau=0.05)", "Sigmoid"] == pytest.approx(best("cosine_softmax+sigmoid"))
    assert c4.loc["Logit normalization (tau=0.04)", "Label smoothing (alpha=0.1)"] == pytest.approx(best("label_smoothing+logit_norm"))
    assert c4.loc["Baseline", "Baseline"] == pytest.approx(best("softmax"))
    assert list(c4.index)[0] == "Baseline"

    c5 = pd.read_csv(out / "tableC5.csv").set_index("objective")
    last = lambda o, v: tr[(tr.objective == o) & (tr.variant == v) & (tr.split == "test")].groupby("seed").apply(
        lambda g: g.loc[g.epoch.idxmax(), "top1"]).mean()
    assert c5.loc["softmax", "AutoAugment top-1"] == pytest.approx(last("softmax", "autoaugment"))
    assert c5.loc["softmax", "Mixup top-1"] == pytest.approx(last("softmax", "mixup"))
    assert np.isnan(c5.loc["sigmoid", "Mixup top-1"]) and "sigmoid [autoaugment" not in " ".join(c5.index)
    assert "**" in (out / "tableC5.md").read_text()
    assert sorted(c5.index) == ["sigmoid", "softmax"]  # objectives trained with AutoAugment or Mixup only

    c6 = pd.read_csv(out / "tableC6.csv").set_index("objective")
    assert c6.loc["sigmoid", "Epochs"] == 5 and c6.loc["sigmoid [with Mixup]", "Epochs"] == 4
    assert c6.loc["sigmoid [with Mixup]", "Top-1 (%)"] == pytest.approx(last("sigmoid", "autoaugment+mixup+decay0.985"))

    e3 = pd.read_csv(out / "tableE3.csv").set_index("objective")
    assert sorted(e3.index) == ["sigmoid", "softmax"]
    assert e3.loc["sigmoid", "AutoAugment R²"] == pytest.approx(0.433) and e3.loc["softmax", "Standard R²"] == pytest.approx(0.351)
    assert e3.loc["sigmoid", "AutoAugment top-1"] == pytest.approx(last("sigmoid", "autoaugment"))


def test_list_names_every_item_or_why_not(capsys):
    assert main(["figures", "--list", "--out", "x"]) == 0
    out = capsys.readouterr().out
    for key in ("table2", "figD3", "tableC1", "tableC4", "tableC5", "tableC6", "tableE3", "figD2", "figE4"):
        assert any(line.startswith(key + " ") for line in out.splitlines()), key
    assert "tableA1  -" in out and "shipped as presets" in out
