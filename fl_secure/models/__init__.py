"""Face-embedding backbones, classification heads and weight I/O (safetensors, safe .pth)."""

from fl_secure.models.cnn import FaceCNN
from fl_secure.models.factory import (
    BACKBONES,
    DEFAULT_BACKBONE,
    get_backbone,
    load_pretrained,
    save_weights,
)
from fl_secure.models.heads import (
    HEAD_KINDS,
    ClassHead,
    CombinedMargin,
    CosineClassifier,
    HeadKind,
    MarginFn,
    MarginHead,
    SoftmaxHead,
    make_head,
    margin_logits,
)
from fl_secure.models.iresnet import IResNet, iresnet
from fl_secure.models.resnet import resnet18_face

__all__ = [
    "BACKBONES",
    "DEFAULT_BACKBONE",
    "HEAD_KINDS",
    "ClassHead",
    "CombinedMargin",
    "CosineClassifier",
    "FaceCNN",
    "HeadKind",
    "IResNet",
    "MarginFn",
    "MarginHead",
    "SoftmaxHead",
    "get_backbone",
    "iresnet",
    "load_pretrained",
    "make_head",
    "margin_logits",
    "resnet18_face",
    "save_weights",
]
