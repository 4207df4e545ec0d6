"""Small models for the model-source tests, built by factories as a user's ``module:`` source would be
(``repsim extract --checkpoint module:tiny_models:vit``), plus Hugging Face checkpoint directories
written from configs (random weights, nothing downloaded)."""
from __future__ import annotations

from pathlib import Path


def vit():
    """torchvision's VisionTransformer: 2 blocks of width 32 on 32-px images (4x4 patches of 8 px + CLS)."""
    from torchvision.models import VisionTransformer

    return VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32,
                             mlp_dim=64, num_classes=10)


def swin():
    """torchvision's SwinTransformer (channels-last stages): 2 + 2 blocks, window 4, any image size."""
    from torchvision.models import SwinTransformer

    return SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[2, 2], num_heads=[2, 2],
                           window_size=[4, 4], num_classes=10)


def convnext():
    """torchvision's ConvNeXt: 2 + 2 CNBlocks of width 16 and 32."""
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    return ConvNeXt([CNBlockConfig(16, 32, 2), CNBlockConfig(32, None, 2)], num_classes=10)


def classifier_first():
    """A generic classifier whose ``nn.Linear`` head is defined before another Linear (``proj``): the
    last-defined Linear is not the classifier, so ``pool`` taps the wrong input (issue 30)."""
    import torch
    from torch import nn

    class ClassifierFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.classifier = nn.Linear(16, 10)
            self.body = nn.Linear(16, 32)
            self.proj = nn.Linear(32, 16)

        def forward(self, x):
            x = nn.functional.adaptive_avg_pool2d(x.mean(1, keepdim=True), 4).flatten(1)
            return self.classifier(torch.relu(self.proj(torch.relu(self.body(x)))))

    return ClassifierFirst()


def fails():
    """A model that raises on every input (a user's bug, not repsim's)."""
    from torch import nn

    class Fails(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            raise RuntimeError("this model refuses every input")

    return Fails()


def hf_vit_dir(path: Path, num_labels: int = 10) -> Path:
    """A Hugging Face ViT image classifier checkpoint directory holding only its config."""
    import transformers

    config = transformers.ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=32,
                                    num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                    num_labels=num_labels, architectures=["ViTForImageClassification"])
    config.save_pretrained(path)
    return path


WORDS = "the a cat dog sat on mat ran fast slow good bad movie film was is not very".split()


def write_reviews(path: Path, n: int = 48, labels: tuple = ("bad", "good")) -> Path:
    """A text CSV (columns text, label) of ``n`` rows of 1..9 words from :data:`WORDS`: rows differ in
    length, so padding differs per row; labels alternate over ``labels``."""
    import csv

    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text", "label"])
        for i in range(n):
            w.writerow([" ".join(WORDS[(3 * i + j) % len(WORDS)] for j in range(i % 9 + 1)), labels[i % len(labels)]])
    return path


def hf_text_dir(path: Path) -> Path:
    """A Hugging Face BERT base model (no head) with a small word-level tokenizer, config only."""
    import transformers
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", *WORDS])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.normalizer = normalizers.Lowercase()
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", pad_token="[PAD]",
                                               cls_token="[CLS]", sep_token="[SEP]")
    tok.save_pretrained(path)
    transformers.BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=32, max_position_embeddings=64).save_pretrained(path)
    return path


def fails_later():
    """A small conv net that computes its first forward passes (the probe, the first batches) and then
    raises: an extraction that fails after its store was created and some chunks were written."""
    import torch
    from torch import nn

    class FailsLater(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(1, 4, 3, padding=1)
            self.fc = nn.Linear(4, 10)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            if self.calls > 3:
                raise ValueError("this model fails on its fourth forward pass")
            return self.fc(torch.relu(self.conv(x)).mean(dim=(2, 3)))

    return FailsLater()


def conv():
    """Two 3x3 convolutions on 1-channel 8x8 digits and a linear head: block1/block2 (4, 6, 6) / (4, 4, 4)
    maps, pool (64,), logits (10,); the option-value smoke of `repsim extract` (test_extract_values)."""
    import torch

    return torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Conv2d(4, 4, 3), torch.nn.ReLU(),
                               torch.nn.Flatten(), torch.nn.Linear(64, 10))
