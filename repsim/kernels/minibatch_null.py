"""The within-batch permutation null of minibatch CKA (linear or RBF): :class:`MinibatchNull`.

Minibatch CKA sums per-batch HSIC (Nguyen, Raghu & Kornblith 2021),

    CKA_mb(i, j) = Σ_B h_B(i, j) / sqrt(Σ_B h_B(i, i) Σ_B h_B(j, j)),   h_B(i, j) = ⟨A_iB, A_jB⟩,

A_iB the batch's U-centred Gram over √(b(b−3)) (HSIC₁, Song et al. 2012) or its double-centred Gram over
b − 1 (HSIC₀).  The null permutes the rows of the column side *within each batch*: draw k replaces
h_B(i, j) by ⟨A_iB, P_Bk A_jB P_Bkᵀ⟩, P_Bk one permutation of the batch's b rows per draw, batch and
store (every column of a store shares it: layer-aggregate calibration, :mod:`repsim.kernels.measures.exact`).
Permutations within batches form a subgroup of all permutations of the examples, so for one pass
over disjoint batches the test is exact (Phipson & Smyth 2010); the self-HSICs, and so the
normalisers, do not change under a permutation.  Over several epochs the examples recur in other
batches: fresh permutations there would pair them anew in every epoch while the data keep one pairing,
so the null would be narrower than the statistic's spread (anti-conservative); the engine therefore
feeds this accumulator the first epoch's batches only.

The K null products of a batch are batched products over the Grams the pass formed
(:func:`repsim.kernels.permutation.gram_null_products`): no rows are re-read.  Draws come from
``default_rng([seed, epoch, group, batch, store])`` (keyed by the batch's place in the plan, so a
resumed or distributed run draws the same ones).  Observed and null sums are both this accumulator's
own float64 products of the same Grams, so a p-value compares like with like.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from repsim.array_api import array_namespace, diagonal, gram_dtype, on_device, to_numpy
from repsim.kernels._gram import is_numpy
from repsim.kernels._precision import CenteredGram, constant_tolerance
from repsim.kernels.hsic import centered_gram, double_center, ucenter
from repsim.kernels.permutation import gram_null_products, permutations

__all__ = ["MinibatchNull"]


def _host_products(A: np.ndarray, B: np.ndarray, perms: np.ndarray, diagonal: bool) -> np.ndarray:
    """:func:`gram_null_products` on the host, its draws split over :func:`repsim.blas.blas_thread_split`'s
    k threads (inside the engine's segments BLAS already runs one thread each)."""
    from repsim.blas import blas_thread_split

    with blas_thread_split() as k:
        parts = [p for p in np.array_split(np.arange(perms.shape[0]), min(k, perms.shape[0])) if p.size]
        if len(parts) < 2:
            return gram_null_products(A, B, perms, diagonal=diagonal)
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=len(parts), thread_name_prefix="repsim-null") as pool:
            return np.concatenate(list(pool.map(lambda i: gram_null_products(A, B, perms[i], diagonal=diagonal),
                                                parts)), axis=0)


class MinibatchNull:
    """Sums over batches of the observed per-batch HSIC (L, L) and of K within-batch null HSICs (K, L, L).

    ``groups``: a group id (store) per column; ``kernel(x, name)``: a batch column -> its centred b × b
    Gram as a :class:`CenteredGram` (default: the linear one; RBF CKA passes its RBF kernel).
    ``update(batch, key)``: ``key`` names the batch's place in the plan (epoch, group, batch).
    ``compute_dtype``: the Gram precision of columns given as rows, as :class:`~repsim.kernels.minibatch_cka.MinibatchCKA`'s."""

    def __init__(self, n_layers: int, groups: Sequence[int], permutations: int, seed: int = 0, *,
                 debiased: bool = True, names: Sequence[str] | None = None,
                 kernel: Callable[[Any, str], CenteredGram] | None = None, compute_dtype: str | None = None) -> None:
        self.n_layers = int(n_layers)
        self.groups = [int(g) for g in groups]
        if len(self.groups) != self.n_layers:
            raise ValueError(f"groups has {len(self.groups)} entries for {self.n_layers} layers")
        self.K = int(permutations)
        self.seed = int(seed)
        self.debiased = bool(debiased)
        self.names = [str(s) for s in names] if names is not None else [f"layer {i}" for i in range(self.n_layers)]
        self.kernel = kernel
        self.compute_dtype = compute_dtype  # the Gram precision of a column given as rows (repsim.array_api.gram_dtype)
        self.obs = np.zeros((self.n_layers, self.n_layers))
        self.null = np.zeros((self.K, self.n_layers, self.n_layers))
        self.n_batches = 0

    def _centered(self, x: Any, name: str, xp: Any, out: Any = None) -> Any:
        """The batch column's HSIC-form matrix A (b × b float64): U(K)/√(b(b−3)) or K/(b − 1), zero
        when the column is constant over the batch.  ``out``: a b × b float64 NumPy buffer to build A
        in (no new b × b array: the analytic null reuses its buffers from batch to batch)."""
        G = self.kernel(x, name) if self.kernel is not None else (
            x if isinstance(x, CenteredGram) else centered_gram(x, xp, name, gram_dtype(x.dtype, xp, self.compute_dtype)))
        K = G.K if G.K.dtype == xp.float64 else xp.astype(G.K, xp.float64)
        b = K.shape[0]
        mean_sq = 0.0 if G.mean_sq is None else G.mean_sq
        trace = xp.sum(diagonal(K, xp))
        keep = xp.astype(trace > constant_tolerance(b, 1.0) * mean_sq, xp.float64)
        scale = keep / (float(np.sqrt(b * (b - 3))) if self.debiased else float(b - 1))
        if not is_numpy(xp):
            return (ucenter(K, xp=xp) if self.debiased else double_center(K, xp=xp)) * scale
        if out is not None:
            np.copyto(out, K)
            K = out
        A = ucenter(K, xp=xp, overwrite=out is not None) if self.debiased else double_center(
            K, xp=xp, overwrite=out is not None)
        A *= scale  # (A is this call's own array, or out: scaled in place)
        return A

    def update(self, batch: Sequence[Any], key: Sequence[int] = ()) -> "MinibatchNull":
        if len(batch) != self.n_layers:
            raise ValueError(f"update got {len(batch)} layers, expected {self.n_layers}")
        first = batch[0].K if isinstance(batch[0], CenteredGram) else batch[0]
        xp = array_namespace(first)
        A = xp.stack([self._centered(x, name, xp) for x, name in zip(batch, self.names)])  # (L, b, b)
        L, b = A.shape[0], A.shape[1]
        flat = xp.reshape(A, (L, b * b))
        obs = to_numpy(flat @ xp.matrix_transpose(flat))
        null = np.empty((self.K, L, L))
        for g in dict.fromkeys(self.groups):
            cols = [j for j in range(L) if self.groups[j] == g]
            perms = permutations(self.K, b, [self.seed, *[int(v) for v in key], g])
            idx = on_device(xp.asarray, np.asarray(cols, dtype=np.int64), device=getattr(A, "device", None))
            B = xp.take(A, idx, axis=0)
            if xp is np:  # the draws split over the BLAS thread budget (each thread single-threaded BLAS)
                null[:, :, cols] = _host_products(A, B, perms, not self.debiased)
            else:
                null[:, :, cols] = to_numpy(gram_null_products(A, B, perms, diagonal=not self.debiased, xp=xp))
        self.obs += (obs + obs.T) / 2
        self.null += null
        self.n_batches += 1
        return self

    def merge(self, other: "MinibatchNull") -> "MinibatchNull":
        if (other.n_layers, other.K, other.debiased, other.groups) != (self.n_layers, self.K, self.debiased,
                                                                         self.groups):
            raise ValueError("cannot merge permutation nulls of different columns, draws or estimators")
        self.obs += other.obs
        self.null += other.null
        self.n_batches += other.n_batches
        return self

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """(observed CKA (L, L), null CKA (K, L, L)); NaN in the rows and columns of columns constant
        over every batch.  Entry (i, j), i <= j, permutes column j's store; (j, i) mirrors it."""
        d = np.diag(self.obs)
        with np.errstate(invalid="ignore", divide="ignore"):
            root = np.sqrt(np.where(d > 0, d, np.nan))
            norm = np.outer(root, root)
            obs = self.obs / norm
            null = self.null / norm[None]
        iu = np.triu_indices(self.n_layers, 1)
        null[:, iu[1], iu[0]] = null[:, iu[0], iu[1]]
        return obs, null

    def to_state(self) -> dict[str, Any]:
        return {"kind": "MinibatchNull", "n_layers": self.n_layers, "groups": np.asarray(self.groups, dtype=np.int64),
                "permutations": self.K, "seed": self.seed, "debiased": self.debiased,
                "names": np.asarray(self.names, dtype=np.str_), "obs": self.obs.copy(), "null": self.null.copy(),
                "n_batches": self.n_batches, "compute_dtype": self.compute_dtype or ""}

    @classmethod
    def from_state(cls, state: dict[str, Any], kernel: Callable[[Any, str], CenteredGram] | None = None
                   ) -> "MinibatchNull":
        if str(state.get("kind")) != "MinibatchNull":
            raise ValueError(f"not a MinibatchNull state (kind={state.get('kind')!r})")
        acc = cls(int(state["n_layers"]), [int(g) for g in np.asarray(state["groups"]).reshape(-1)],
                  int(state["permutations"]), int(state["seed"]), debiased=bool(state["debiased"]),
                  names=[str(s) for s in np.asarray(state["names"]).reshape(-1)], kernel=kernel,
                  compute_dtype=str(state.get("compute_dtype", "")) or None)
        acc.obs = np.array(state["obs"], dtype=np.float64)
        acc.null = np.array(state["null"], dtype=np.float64)
        acc.n_batches = int(state["n_batches"])
        return acc
