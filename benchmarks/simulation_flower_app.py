"""The Flower side of ``benchmarks/simulation.py``: the same workload on Flower's simulation.

Runs in a separate virtual environment with Flower 1.42 (``flwr[simulation]``, its Ray
backend), through Flower's public API only: a ``ClientApp`` whose ``train`` handler trains
the model on the virtual client's images, a ``ServerApp`` running ``FedAvg`` with
``fraction_train`` = clients per round / clients, started with
``flwr.simulation.run_simulation``. The model is fl-secure's ``cnn-small`` backbone
(:class:`fl_secure.models.cnn.FaceCNN`, widths 16-32-64-128, GroupNorm) with a CosFace head
(s = 64, m = 0.35: fl-secure's default head), rewritten here in plain torch so that this file
imports nothing of fl-secure; the data are the arrays the benchmark exported from
fl-secure's plan (``images.npy``, ``labels.npy``, ``offsets.npy``: client ``k`` holds rows
``offsets[k]:offsets[k + 1]``). Same batch size, one local epoch, SGD with momentum.

Usage (the benchmark runs it): ``FLB_DATA=DIR FLB_ROUNDS=20 FLB_FRACTION=0.1 ...
/work/flwr-venv/bin/python benchmarks/simulation_flower_app.py``; it prints one JSON line.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.simulation import run_simulation
from torch import nn

DATA = os.environ.get("FLB_DATA", "")
EMBEDDING = int(os.environ.get("FLB_EMBEDDING", "32"))
BATCH = int(os.environ.get("FLB_BATCH", "8"))
LR = float(os.environ.get("FLB_LR", "0.05"))
THREADS = int(os.environ.get("FLB_THREADS", "1"))


def _gn(channels: int, groups: int = 8) -> nn.GroupNorm:
    return nn.GroupNorm(math.gcd(channels, groups), channels)


class Block(nn.Module):
    """Basic residual block with GroupNorm (as FaceCNN's)."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, 2, padding=1, bias=False)
        self.norm1 = _gn(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, padding=1, bias=False)
        self.norm2 = _gn(cout)
        self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, 2, bias=False), _gn(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.norm1(self.conv1(x)))
        return F.relu(self.norm2(self.conv2(out)) + self.shortcut(x))


class Net(nn.Module):
    """cnn-small (stem, four stages 16-32-64-128, pooling, linear embedding) + CosFace head."""

    def __init__(self, classes: int, embedding: int = EMBEDDING) -> None:
        super().__init__()
        widths = (16, 32, 64, 128)
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, padding=1, bias=False), _gn(16), nn.ReLU())
        self.stages = nn.Sequential(
            *(Block(a, b) for a, b in zip((16, *widths[:-1]), widths, strict=True))
        )
        self.embedding = nn.Linear(widths[-1], embedding)
        self.head = nn.Parameter(torch.randn(classes, embedding) * 0.01)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        e = self.embedding(F.adaptive_avg_pool2d(self.stages(self.stem(x)), 1).flatten(1))
        cos = F.linear(F.normalize(e, dim=1), F.normalize(self.head, dim=1))
        margin = F.one_hot(labels, cos.shape[1]).to(cos.dtype) * 0.35
        return 64.0 * (cos - margin)


_cache: dict[str, np.ndarray] = {}


def _data() -> dict[str, np.ndarray]:
    """The exported arrays, memory-mapped once per worker process."""
    if not _cache:
        for name in ("images", "labels", "offsets"):
            _cache[name] = np.load(os.path.join(DATA, f"{name}.npy"), mmap_mode="r")
    return _cache


def classes() -> int:
    return int(np.load(os.path.join(DATA, "classes.npy")))


client = ClientApp()


@client.train()
def train(msg: Message, context: Context) -> Message:
    """One local epoch of SGD on this virtual client's images; return the new weights."""
    # before the model is built: set after it, the same call ran ~12x slower (11.9 vs 139
    # clients/s, python benchmarks/simulation.py --rows flower --rounds 10, 2 cores)
    torch.set_num_threads(THREADS)
    model = Net(classes())
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    examples, loss = local_epoch(model, int(context.node_config["partition-id"]))
    reply = RecordDict(
        {
            "arrays": ArrayRecord(model.state_dict()),
            "metrics": MetricRecord({"num-examples": examples, "loss": loss}),
        }
    )
    return Message(content=reply, reply_to=msg)


def local_epoch(model: Net, k: int) -> tuple[int, float]:
    """One local epoch of SGD of ``model`` on client ``k``'s images: (examples, last loss)."""
    torch.set_num_threads(THREADS)
    data = _data()
    lo, hi = int(data["offsets"][k]), int(data["offsets"][k + 1])
    images = torch.from_numpy(np.array(data["images"][lo:hi]))
    labels = torch.from_numpy(np.array(data["labels"][lo:hi]))
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=5e-4)
    order = torch.randperm(len(images))
    for start in range(0, len(images), BATCH):
        batch = order[start : start + BATCH]
        opt.zero_grad()
        loss = F.cross_entropy(model(images[batch], labels[batch]), labels[batch])
        loss.backward()
        opt.step()
    return len(images), float(loss)


server = ServerApp()
RESULT: dict[str, Any] = {}
ROUND_ENDS: list[float] = []  # perf_counter() as each round's replies are aggregated


class TimedFedAvg(FedAvg):
    """FedAvg that notes when each round's training replies are aggregated."""

    def aggregate_train(self, server_round, replies):  # type: ignore[no-untyped-def]
        """FedAvg's aggregation, then the time."""
        result = super().aggregate_train(server_round, replies)
        ROUND_ENDS.append(time.perf_counter())
        return result


@server.main()
def main(grid: Grid, context: Context) -> None:
    """FedAvg over a sampled fraction of the virtual clients, no federated evaluation."""
    rounds = int(os.environ.get("FLB_ROUNDS", "20"))
    fraction = float(os.environ.get("FLB_FRACTION", "0.1"))
    strategy = TimedFedAvg(fraction_train=fraction, fraction_evaluate=0.0, min_available_nodes=2)
    torch.manual_seed(0)
    initial = ArrayRecord(Net(classes()).state_dict())
    started = time.perf_counter()
    strategy.start(
        grid=grid, initial_arrays=initial, num_rounds=rounds, train_config=ConfigRecord()
    )
    RESULT["rounds_s"] = time.perf_counter() - started
    RESULT["round_ends_s"] = [t - started for t in ROUND_ENDS]


def run(
    server_app: Any = server, client_app: Any = client, result: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Run the simulation of these apps; the figures (``result``: what the server app noted)."""
    nodes = int(os.environ.get("FLB_CLIENTS", "1000"))
    cpus = int(os.environ.get("FLB_CPUS", str(os.cpu_count() or 1)))
    started = time.perf_counter()
    run_simulation(
        server_app=server_app,
        client_app=client_app,
        num_supernodes=nodes,
        backend_config={
            "client_resources": {"num_cpus": THREADS, "num_gpus": 0.0},
            "init_args": {"num_cpus": cpus, "include_dashboard": False},
        },
    )
    return {"total_s": time.perf_counter() - started, **(RESULT if result is None else result)}


if __name__ == "__main__":
    print(json.dumps(run()))
