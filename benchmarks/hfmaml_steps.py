"""One HF-MAML client's training loss over rounds: the outer step and the inner ``alpha``.

The experiment bases' model and settings (``examples/experiments/base/hfmaml_synthetic.toml``:
``cnn-small``, 128-d embedding, ArcFace s 8 m 0.5, 15 local steps of batch 32, SGD lr 0.01
momentum 0.9 weight decay 5e-4) on one client holding 20 synthetic identities x 10 images;
the optimiser's state is reset every round as in a run. Prints one JSON object: the mean
training loss ``f(w~, D')`` of each round, for each ``alpha`` given.

Run on 2 cores (about a minute per alpha)::

    python benchmarks/hfmaml_steps.py [--alpha 0.001 0.01] [--rounds 10]
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from fl_secure.algorithms import get_strategy
from fl_secure.config import AlgorithmConfig, ModelConfig
from fl_secure.data.synthetic import SyntheticFaceConfig, generate_synthetic_faces
from fl_secure.messages import LocalTraining
from fl_secure.training import build_model

MODEL = ModelConfig(backbone="cnn-small", embedding_size=128, head="arcface", scale=8.0, margin=0.5)
TRAINING = LocalTraining(
    local_steps=15, batch_size=32, learning_rate=0.01, momentum=0.9, weight_decay=5e-4
)


def round_losses(alpha: float, rounds: int) -> list[float]:
    """The client's mean HF-MAML loss in each of ``rounds`` rounds."""
    faces = generate_synthetic_faces(
        SyntheticFaceConfig(num_identities=20, images_per_identity=10, image_size=32, seed=0)
    )
    strategy = get_strategy("hfmaml", AlgorithmConfig(name="hfmaml", alpha=alpha))
    data = strategy.local_data(faces, faces, np.arange(20))
    model = build_model(MODEL, 20, 32, seed=0)
    generator = torch.Generator().manual_seed(0)
    return [
        round(strategy.local_train(model, data, TRAINING, generator=generator)["train_loss"], 3)
        for _ in range(rounds)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--alpha", type=float, nargs="+", default=[0.001, 0.01])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = {f"alpha={a:g}": round_losses(a, args.rounds) for a in args.alpha}
    print(json.dumps({"round_losses": result}))


if __name__ == "__main__":
    main()
