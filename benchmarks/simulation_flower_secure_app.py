"""Flower's secure row of ``benchmarks/simulation.py``: SecAgg+ and client-side DP in Flower.

The workload of :mod:`simulation_flower_app` (same model, images, batch, one local epoch,
FedAvg over ``fraction = clients per round / clients``, Flower 1.42's simulation engine on
Ray), with Flower's own privacy stack as its documentation composes it:

* SecAgg+ (Bell et al., CCS 2020): the legacy ``ServerApp`` runs
  ``DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(num_shares, reconstruction_threshold))``
  over a ``LegacyContext``; the ``ClientApp`` wraps a ``NumPyClient`` with
  ``mods=[secaggplus_mod, fixedclipping_mod]`` (clipping runs inside SecAgg+, on the update
  before it is masked). ``FLB_SHARES`` (33) counts a client's own share: Flower's neighbours
  are the ``num_shares // 2`` nodes on either side in a shuffled ring, so 33 shares are 32
  neighbours, as fl-secure's k = 32; ``FLB_THRESHOLD`` (21) shares rebuild a secret, as
  fl-secure's t = 21. Each round has four message exchanges with every sampled client
  (setup, share keys, masked vectors, unmask); the client's weighted parameters are
  quantized to ``[0, 2^22)`` after clipping each to ``[-8, 8]`` and masked mod ``2^32``
  (Flower's defaults);
* DP: ``DifferentialPrivacyClientSideFixedClipping(FedAvg, noise_multiplier=FLB_NOISE (1),
  clipping_norm=FLB_CLIP (1), num_sampled_clients)``; the clients clip their update's L2
  norm (``fixedclipping_mod``) and the server adds Gaussian noise of standard deviation
  ``z C / m`` to the unmasked average. Flower keeps no privacy ledger here and its legacy
  wrapper has no accountant.

``round_ends_s`` are taken when the inner ``FedAvg`` aggregates a round (the unmask stage's
end), from when the workflow asks it for the initial parameters, as the plain row's.

Usage (the benchmark runs it): ``FLB_DATA=DIR FLB_ROUNDS=20 FLB_FRACTION=0.1 ...
/work/flwr-venv/bin/python benchmarks/simulation_flower_secure_app.py``; one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# the Ray workers unpickle this app's functions, which refer to simulation_flower_app
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")]))

import torch  # noqa: E402
from flwr.client import ClientApp, NumPyClient  # noqa: E402
from flwr.client.mod import fixedclipping_mod, secaggplus_mod  # noqa: E402
from flwr.common import Context, ndarrays_to_parameters  # noqa: E402
from flwr.server import Grid, LegacyContext, ServerApp, ServerConfig  # noqa: E402
from flwr.server.strategy import (  # noqa: E402
    DifferentialPrivacyClientSideFixedClipping,
    FedAvg,
)
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow  # noqa: E402

# (classes as num_classes: a global named like torch's submodule torch.classes would make
# Ray's cloudpickle try to pickle that submodule with the functions that use it)
from simulation_flower_app import THREADS, Net, local_epoch  # noqa: E402
from simulation_flower_app import classes as num_classes  # noqa: E402
from simulation_flower_app import run as run_apps  # noqa: E402

SHARES = int(os.environ.get("FLB_SHARES", "33"))
THRESHOLD = int(os.environ.get("FLB_THRESHOLD", "21"))
NOISE = float(os.environ.get("FLB_NOISE", "1.0"))
CLIP = float(os.environ.get("FLB_CLIP", "1.0"))


class SecureRowClient(NumPyClient):
    """The virtual client ``k``: one local epoch on its images (``local_epoch``)."""

    def __init__(self, k: int) -> None:
        self.k = k

    def fit(self, parameters, config):  # type: ignore[no-untyped-def]
        """Load the global parameters, train, return the new ones and the example count."""
        torch.set_num_threads(THREADS)  # before the model is built (simulation_flower_app.py)
        model = Net(num_classes())
        names = list(model.state_dict())
        model.load_state_dict(
            {n: torch.from_numpy(p) for n, p in zip(names, parameters, strict=True)}
        )
        examples, loss = local_epoch(model, self.k)
        return [v.detach().numpy() for v in model.state_dict().values()], examples, {"loss": loss}


def client_fn(context: Context):  # type: ignore[no-untyped-def]
    """The ``NumPyClient`` of this virtual node's partition."""
    return SecureRowClient(int(context.node_config["partition-id"])).to_client()


client = ClientApp(client_fn=client_fn, mods=[secaggplus_mod, fixedclipping_mod])

server = ServerApp()
RESULT: dict[str, Any] = {}
STARTED: list[float] = []  # perf_counter() when the workflow takes the initial parameters
ROUND_ENDS: list[float] = []  # perf_counter() as each round's unmasked sum is aggregated


class TimedFedAvg(FedAvg):
    """Flower's legacy FedAvg noting when the rounds start and when each is aggregated."""

    def initialize_parameters(self, client_manager):  # type: ignore[no-untyped-def]
        """The initial parameters; the rounds start now."""
        STARTED.append(time.perf_counter())
        return super().initialize_parameters(client_manager)

    def aggregate_fit(self, server_round, results, failures):  # type: ignore[no-untyped-def]
        """FedAvg's aggregation of the unmasked sum, then the time."""
        result = super().aggregate_fit(server_round, results, failures)
        ROUND_ENDS.append(time.perf_counter())
        return result


@server.main()
def main(grid: Grid, context: Context) -> None:
    """SecAgg+ rounds of DP-FedAvg over a sampled fraction, no federated evaluation."""
    nodes = int(os.environ.get("FLB_CLIENTS", "1000"))
    rounds = int(os.environ.get("FLB_ROUNDS", "20"))
    fraction = float(os.environ.get("FLB_FRACTION", "0.1"))
    torch.manual_seed(0)
    initial = [v.numpy() for v in Net(num_classes()).state_dict().values()]
    inner = TimedFedAvg(
        fraction_fit=fraction,
        fraction_evaluate=0.0,
        min_fit_clients=2,
        min_available_clients=2,
        initial_parameters=ndarrays_to_parameters(initial),
    )
    per_round = max(int(nodes * fraction), 2)  # what legacy FedAvg samples
    strategy = DifferentialPrivacyClientSideFixedClipping(
        inner, noise_multiplier=NOISE, clipping_norm=CLIP, num_sampled_clients=per_round
    )
    legacy = LegacyContext(
        context=context, config=ServerConfig(num_rounds=rounds), strategy=strategy
    )
    workflow = DefaultWorkflow(
        fit_workflow=SecAggPlusWorkflow(num_shares=SHARES, reconstruction_threshold=THRESHOLD)
    )
    workflow(grid, legacy)
    started = STARTED[0]
    RESULT["rounds_s"] = time.perf_counter() - started
    RESULT["round_ends_s"] = [t - started for t in ROUND_ENDS]
    RESULT["secure"] = {
        "secure_aggregation": "flower SecAggPlusWorkflow + secaggplus_mod",
        "num_shares": SHARES,
        "neighbours": SHARES - 1 if SHARES < per_round else per_round - 1,
        "reconstruction_threshold": THRESHOLD,
        "dp": "DifferentialPrivacyClientSideFixedClipping + fixedclipping_mod",
        "noise_multiplier": NOISE,
        "clipping_norm": CLIP,
        "noise_stdev_on_mean": NOISE * CLIP / per_round,
        "accountant": None,
    }


if __name__ == "__main__":
    print(json.dumps(run_apps(server, client, RESULT)))
