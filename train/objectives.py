"""The nine objectives of Kornblith et al. (2021), §2, Eq. 1–9, each owning the final layer.

Notation (paper §2): x ∈ R^M penultimate features, z = W x + b ∈ R^K logits, t one-hot targets.
Every objective is one :class:`Head` — an ``nn.Module`` holding ``weight`` (K, M) and ``bias`` (K,) —
built from three independent parts, so the combinations of Appendix Table C.4 are compositions:

* **logit map** (how features become the vector that enters the loss)
  ``linear``      z = W x + b
  ``logit_norm``  z / (τ ‖z‖)                                   (Eq. 6)
  ``cosine``      sim(W_k, x) / τ + b_k                         (Eq. 7)
* **loss** on that vector, per example, averaged over the batch
  ``softmax``        −Σ t_k z_k + log Σ e^{z_k}                  (Eq. 1)
  label smoothing α  −1/(1−α) Σ ((1−α) t_k + α/K) log softmax(z)_k   (Eq. 2)
  ``sigmoid``        −Σ t_k z_k + Σ log(e^{z_k} + 1)             (Eq. 8), biases initialised to −log K
  ``squared_error``  s · (1/K) Σ (κ t_k (z_k − M)² + (1 − t_k) z_k²)   (Eq. 9, Hui & Belkin; s = loss scale)
* **regularisers**
  dropout ρ        x̃ = x ⊙ ξ/ρ, ξ_i ~ Bernoulli(ρ), training mode only (Eq. 3)
  logit penalty β  + β ‖z‖² per example, z the vector entering the loss (Eq. 5)
  extra L2 λ       + λ ‖W‖²_F once per batch (Eq. 4)
  loss × τ         cosine softmax with ``scale_by_tau`` (main text, footnote 1 of Table 4)

``make_objective(name, in_features, num_classes, **hyper)`` accepts the nine objective names and
``+``-joined combinations such as ``"sigmoid+dropout"`` or ``"cosine_softmax+logit_penalty"``.
Hyperparameters default to the bold values of Appendix Table A.1 (ResNet-50, ImageNet).
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

OBJECTIVES: tuple[str, ...] = (
    "softmax",
    "label_smoothing",
    "sigmoid",
    "extra_l2",
    "dropout",
    "logit_penalty",
    "logit_norm",
    "cosine_softmax",
    "squared_error",
)

# Bold values of Appendix Table A.1 (ResNet-50 on ImageNet).
DEFAULTS: dict[str, dict[str, Any]] = {
    "softmax": {},
    "label_smoothing": {"alpha": 0.1},
    "sigmoid": {},
    "extra_l2": {"lambda_final": 8e-4},
    "dropout": {"keep_prob": 0.7},
    "logit_penalty": {"beta": 6e-4},
    "logit_norm": {"tau": 0.04},
    "cosine_softmax": {"tau": 0.05, "scale_by_tau": False},
    "squared_error": {"kappa": 9.0, "M": 60.0, "loss_scale": 10.0},
}

# Role of each component in a combination: one loss, at most one logit map, any regularisers.
_LOSS = {"softmax", "label_smoothing", "sigmoid", "squared_error"}
_MAP = {"logit_norm", "cosine_softmax"}
_REG = {"extra_l2", "dropout", "logit_penalty"}


def _up(t: torch.Tensor) -> torch.Tensor:
    """float16/bfloat16 (AMP) → float32 for the loss; float32/float64 unchanged."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


class Head(nn.Module):
    """Final layer plus loss. ``head(x)`` → the logits used for prediction (the vector entering the
    loss, without dropout in eval mode); ``head.loss(x, t)`` → batch-mean loss (a scalar tensor)."""

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        *,
        loss: str = "softmax",
        logit_map: str = "linear",
        alpha: float = 0.0,
        tau: float | None = None,
        scale_by_tau: bool = False,
        keep_prob: float = 1.0,
        beta: float = 0.0,
        lambda_final: float = 0.0,
        kappa: float = 1.0,
        M: float = 1.0,
        loss_scale: float = 1.0,
        name: str = "",
    ) -> None:
        super().__init__()
        if loss not in ("softmax", "sigmoid", "squared_error"):
            raise ValueError(f"unknown loss {loss!r}")
        if logit_map not in ("linear", "logit_norm", "cosine"):
            raise ValueError(f"unknown logit map {logit_map!r}")
        if in_features < 1 or num_classes < 2:
            raise ValueError(f"need in_features >= 1 and num_classes >= 2, got {in_features}, {num_classes}")
        if not 0.0 <= alpha < 1.0:
            raise ValueError(f"label smoothing alpha must be in [0, 1), got {alpha}")
        if alpha and loss != "softmax":
            raise ValueError("label smoothing applies to the softmax loss only")
        if logit_map != "linear" and (tau is None or tau <= 0):
            raise ValueError(f"{logit_map} needs a temperature tau > 0, got {tau}")
        if not 0.0 < keep_prob <= 1.0:
            raise ValueError(f"dropout keep_prob must be in (0, 1], got {keep_prob}")
        if beta < 0 or lambda_final < 0 or kappa <= 0 or loss_scale <= 0:
            raise ValueError("beta, lambda_final must be >= 0 and kappa, loss_scale > 0")
        self.in_features, self.num_classes = int(in_features), int(num_classes)
        self.loss_name, self.logit_map, self.name = loss, logit_map, name or loss
        self.alpha, self.tau, self.scale_by_tau = float(alpha), tau, bool(scale_by_tau)
        self.keep_prob, self.beta, self.lambda_final = float(keep_prob), float(beta), float(lambda_final)
        self.kappa, self.M, self.loss_scale = float(kappa), float(M), float(loss_scale)
        self.weight = nn.Parameter(torch.empty(num_classes, in_features))
        self.bias = nn.Parameter(torch.empty(num_classes))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's initialisation; sigmoid biases start at −log K (paper §2, Eq. 8)."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        bound = 1.0 / math.sqrt(self.in_features)
        nn.init.uniform_(self.bias, -bound, bound)
        if self.loss_name == "sigmoid":
            nn.init.constant_(self.bias, -math.log(self.num_classes))

    def extra_repr(self) -> str:
        return (f"{self.name}: in_features={self.in_features}, num_classes={self.num_classes}, "
                f"hyper={self.hyper()}")

    def hyper(self) -> dict[str, Any]:
        """The hyperparameters that differ from the plain softmax defaults."""
        out: dict[str, Any] = {}
        if self.alpha:
            out["alpha"] = self.alpha
        if self.tau is not None:
            out["tau"] = self.tau
        if self.scale_by_tau:
            out["scale_by_tau"] = True
        if self.keep_prob != 1.0:
            out["keep_prob"] = self.keep_prob
        if self.beta:
            out["beta"] = self.beta
        if self.lambda_final:
            out["lambda_final"] = self.lambda_final
        if self.loss_name == "squared_error":
            out.update(kappa=self.kappa, M=self.M, loss_scale=self.loss_scale)
        return out

    # -- logits ---------------------------------------------------------------------------------
    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        # the head runs in float32 (float64 if given) even under AMP: a bf16 cosine / τ = 0.05 would
        # carry ~0.05 absolute logit error
        with torch.autocast(x.device.type, enabled=False):
            return self._logits_fp(_up(x))

    def _logits_fp(self, x: torch.Tensor) -> torch.Tensor:
        if self.keep_prob < 1.0 and self.training:  # Eq. 3: x̃ = x ⊙ ξ / ρ
            x = F.dropout(x, p=1.0 - self.keep_prob, training=True)
        if self.logit_map == "cosine":  # Eq. 7: sim(W_k, x)/τ + b_k
            w = F.normalize(_up(self.weight), dim=1)
            return F.normalize(_up(x), dim=1) @ w.t() / self.tau + _up(self.bias)
        z = _up(F.linear(x, self.weight, self.bias))
        if self.logit_map == "logit_norm":  # Eq. 6: z / (τ ‖z‖)
            z = z / (self.tau * z.norm(dim=1, keepdim=True).clamp_min(1e-12))
        return z

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._logits(x)

    # -- loss -----------------------------------------------------------------------------------
    def loss_and_logits(self, x: torch.Tensor, targets: torch.Tensor,
                        mix: tuple[torch.Tensor, float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch-mean loss and the logits it was computed from (one forward through the head).

        ``mix=(targets_b, lam)`` (Mixup, :mod:`train.augment`): the per-example loss is
        lam·L(z, targets) + (1 − lam)·L(z, targets_b) from one set of logits (one dropout mask), i.e. the
        loss at the mixed target, since every loss here is linear in the one-hot target.
        """
        z = self._logits(x)
        per = self._per_example(z, targets)
        if mix is not None:
            targets_b, lam = mix
            per = lam * per + (1.0 - lam) * self._per_example(z, targets_b)
        loss = per.mean()
        if self.scale_by_tau:
            loss = loss * self.tau
        if self.lambda_final:  # Eq. 4, once per batch
            loss = loss + self.lambda_final * (_up(self.weight) ** 2).sum()
        return loss, z

    def _per_example(self, z: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-example loss (Eqs. 1, 2, 8, 9, plus the logit penalty Eq. 5) at integer ``targets``."""
        K = self.num_classes
        if self.loss_name == "softmax":
            # F.cross_entropy's label_smoothing uses targets (1−α) t + α/K, i.e. Eq. 2 times (1−α).
            per = F.cross_entropy(z, targets, reduction="none", label_smoothing=self.alpha)
            if self.alpha:
                per = per / (1.0 - self.alpha)
        elif self.loss_name == "sigmoid":  # Eq. 8 summed over classes
            t = F.one_hot(targets, K).to(z.dtype)
            per = F.binary_cross_entropy_with_logits(z, t, reduction="none").sum(1)
        else:  # Eq. 9
            t = F.one_hot(targets, K).to(z.dtype)
            per = (self.kappa * t * (z - self.M) ** 2 + (1 - t) * z**2).mean(1) * self.loss_scale
        if self.beta:  # Eq. 5
            per = per + self.beta * (z**2).sum(1)
        return per

    def loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss_and_logits(x, targets)[0]


def parse_objective(name: str) -> list[str]:
    """Split ``"a+b"`` into validated components (one loss at most, one logit map at most)."""
    parts = [p.strip() for p in str(name).split("+") if p.strip()]
    if not parts:
        raise ValueError("empty objective name")
    for p in parts:
        if p not in OBJECTIVES:
            raise ValueError(f"unknown objective {p!r}; choose from {', '.join(OBJECTIVES)} (or join with '+')")
    if len(set(parts)) != len(parts):
        raise ValueError(f"objective {name!r} repeats a component")
    if sum(p in _LOSS for p in parts) > 1:
        raise ValueError(f"objective {name!r} combines two losses ({', '.join(p for p in parts if p in _LOSS)})")
    if sum(p in _MAP for p in parts) > 1:
        raise ValueError(f"objective {name!r} combines logit_norm and cosine_softmax")
    if "squared_error" in parts and any(p in _MAP for p in parts):
        raise ValueError("squared_error cannot be combined with a normalised logit map")
    return parts


def objective_defaults(name: str) -> dict[str, Any]:
    """Default hyperparameters of an objective or combination (Table A.1 bold values)."""
    out: dict[str, Any] = {}
    for p in parse_objective(name):
        out.update(DEFAULTS[p])
    return out


def make_objective(name: str, in_features: int, num_classes: int, **hyper: Any) -> Head:
    """Build the head of objective ``name`` (one of :data:`OBJECTIVES` or a ``+`` combination).

    Unknown hyperparameters raise ``ValueError``; missing ones take the Table A.1 bold values.
    """
    parts = parse_objective(name)
    params = objective_defaults(name)
    unknown = sorted(set(hyper) - set(params))
    if unknown:
        allowed = ", ".join(sorted(params)) or "none"
        raise ValueError(f"unknown hyperparameter(s) {', '.join(unknown)} for objective {name!r} (allowed: {allowed})")
    params.update(hyper)
    loss = "sigmoid" if "sigmoid" in parts else "squared_error" if "squared_error" in parts else "softmax"
    logit_map = "cosine" if "cosine_softmax" in parts else "logit_norm" if "logit_norm" in parts else "linear"
    return Head(in_features, num_classes, loss=loss, logit_map=logit_map, name="+".join(parts),
                **{k: v for k, v in params.items()})
