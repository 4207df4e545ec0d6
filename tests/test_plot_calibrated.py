"""`repsim plot --calibrated` (and ``SimilarityResult.plot(calibrated=True)``): the calibrated scores of the
file's permutation null, the dotted cells exactly those with p > α (checked on the figure's data, not its
pixels), and a one-line refusal for a file without a null."""
from __future__ import annotations

import numpy as np
import pytest

from repsim import save_store, similarity_matrix
from repsim.commands.main import main

N, K = 50, 49


@pytest.fixture(scope="module")
def result_file(tmp_path_factory):
    """Three stores of 3 layers: a and b share a signal in layer0 and layer1, c is noise everywhere; layer2
    is noise in every store. Exact linear CKA with K = 49 draws; saved beside a copy without the null."""
    root = tmp_path_factory.mktemp("plot")
    rng = np.random.default_rng(0)
    z = rng.normal(size=(N, 6))
    paths = []
    for name in ("a", "b", "c"):
        layers = {}
        for i in range(3):
            signal = z @ rng.normal(size=(6, 12)) if name != "c" and i < 2 else 0
            layers[f"layer{i}"] = (signal + 0.5 * rng.normal(size=(N, 12))).astype(np.float32)
        p = root / f"{name}.zarr"
        save_store(p, layers, np.arange(N) % 2, meta={"dataset": {"name": "planted", "split": "test"}}, progress=False)
        paths.append(str(p))
    result = similarity_matrix(paths, ["linear_cka"], method="exact", permutations=K, seed=3, progress=False)
    result.save(root / "with_null.npz")
    plain = similarity_matrix(paths, ["linear_cka"], method="exact", progress=False)
    plain.save(root / "plain.npz")
    return root, result


def _dots(fig) -> list[set[tuple[int, int]]]:
    out = []
    for ax in fig.axes:
        cells = set()
        for c in ax.collections:
            if c.get_gid() == "not-significant":
                cells |= {(int(round(y)), int(round(x))) for x, y in c.get_offsets()}
        out.append(cells)
    return out


def test_matrix_marks_are_the_cells_with_p_above_alpha(result_file):
    _, result = result_file
    p = result.pvalues("linear_cka")
    want = {(i, j) for i, j in zip(*np.nonzero(p > 0.05))}
    fig = result.plot("linear_cka", calibrated=True)
    marked = [d for d in _dots(fig) if d]
    assert marked == [want]
    # the planted truth: a and b's layer0/layer1 against each other significant, c and layer2 at chance
    idx = {key: i for i, key in enumerate(result.index)}
    assert (idx[("a", "layer0")], idx[("b", "layer1")]) not in want
    assert sum((idx[("a", "layer0")], idx[(s, "layer2")]) in want for s in "abc") >= 2
    # the panel shows the calibrated scores, 0 where not above chance
    img = fig.axes[0].get_images()[0].get_array()
    np.testing.assert_allclose(np.ma.filled(img, np.nan), result.calibrated("linear_cka"))
    assert fig.axes[0].get_images()[0].get_clim() == (0.0, 1.0)


def test_grid_marks_each_store_pair_panel(result_file):
    _, result = result_file
    p = result.pvalues("linear_cka")
    fig = result.plot("linear_cka", kind="grid", calibrated=True)
    panels = [ax for ax in fig.axes if ax.get_images()]
    assert len(panels) == 9
    for k, ax in enumerate(panels):
        r, c = divmod(k, 3)
        block = p[3 * r:3 * r + 3, 3 * c:3 * c + 3]
        assert _dots(fig)[fig.axes.index(ax)] == {(i, j) for i, j in zip(*np.nonzero(block > 0.05))}


def test_cli_writes_the_png_and_counts_the_marks(result_file, capsys):
    root, result = result_file
    out = root / "cal.png"
    assert main(["plot", str(root / "with_null.npz"), "--out", str(out), "--calibrated"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    n = int((result.pvalues("linear_cka") > 0.05).sum())
    assert f"cells not significant (p > 0.05, dotted): linear_cka {n} of 81" in capsys.readouterr().err


def test_cli_refuses_a_file_without_a_null_in_one_line(result_file, capsys):
    root, _ = result_file
    assert main(["plot", str(root / "plain.npz"), "--out", str(root / "x.png"), "--calibrated"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no null for linear_cka" in err[0] and "--permutations K" in err[0]
    assert not (root / "x.png").exists()
    with pytest.raises(ValueError, match="no null for linear_cka"):
        __import__("repsim").load_result(root / "plain.npz").plot(calibrated=True)
