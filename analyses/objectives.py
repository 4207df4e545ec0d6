"""Names of the nine objectives in the paper's order (Table 1) and their display names (no heavy imports)."""
from __future__ import annotations

# Paper order (Table 1) and display names of the nine objectives; anything else is appended.
OBJECTIVES: tuple[str, ...] = (
    "softmax", "label_smoothing", "sigmoid", "extra_l2", "dropout",
    "logit_penalty", "logit_norm", "cosine_softmax", "squared_error",
)
DISPLAY: dict[str, str] = {
    "softmax": "Softmax", "label_smoothing": "Label smoothing", "sigmoid": "Sigmoid",
    "extra_l2": "More final layer L²", "dropout": "Dropout", "logit_penalty": "Logit penalty",
    "logit_norm": "Logit normalization", "cosine_softmax": "Cosine softmax",
    "squared_error": "Squared error", "init": "Initialization",
}
