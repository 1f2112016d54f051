"""An in-process SecAgg+ cohort round (the simulation's) vs the cost-only mode, in one run; JSON.

For each cohort size ``n`` and vector length ``d`` one real SecAgg+ round runs in this
process (:func:`privacy.secagg.in_process.run_cohort_round`: every client's keys, shares,
masked input, consistency signature and unmasking, and the server's routing and unmasking,
serially on one core) with ``--dropout`` of the cohort dropping, spread over the five stages;
then the cost-only mode (:func:`privacy.secagg.cost_only.cost_only_round`, NOT secure
aggregation: a plain sum) on the same inputs and dropouts. Reported per row: the real round's
seconds (its stages; the clients' and the server's compute), the protocol bytes a client
sends and receives (measured: the payloads of the wire, without gRPC framing), the
cost-only round's seconds and the ratio, and the cost-only mode's modelled seconds and bytes
(from a real probe round of ``--probe`` clients) against the measured ones. Bytes per client
are means over the cohort, its dropped members included. The round shares signature
verification across the cohort (``SharedVerificationKey``); ``--unshared`` also times it with
every client verifying for itself (a real client's compute).

Usage: python benchmarks/secagg_in_process.py [--sizes 50 100 200] [--params 10000 100000]
                                              [--dropout 0.1] [--probe 20] [--unshared]
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fl_secure.config import SecureAggregationConfig  # noqa: E402
from privacy.secagg.cost_only import cost_only_round, probe_costs  # noqa: E402
from privacy.secagg.in_process import cohort_setup, encode_update, run_cohort_round  # noqa: E402


def row(
    cfg: SecureAggregationConfig, n: int, d: int, dropout: float, probe: int, unshared: bool
) -> dict:
    """One cohort size and vector length: the real round and the cost-only one."""
    rng = np.random.default_rng(n * 7919 + d)
    ids = [f"site-{i:05d}" for i in range(n)]
    setup = cohort_setup(cfg, ids, d, round_id=secrets.token_bytes(16))
    encoded = {c: encode_update(setup, rng.uniform(-0.5, 0.5, d)) for c in ids}
    dropped = rng.permutation(ids)[: int(dropout * n)]
    drops = {str(c): i % 5 for i, c in enumerate(dropped)}
    probe_costs(cfg, d, probe)  # measured once, before the clock (cached per process)
    real = run_cohort_round(setup, encoded, round_id=setup.round_id, dropouts=drops)
    assert real.aborted is None, real.aborted
    start = time.perf_counter()
    plain = cost_only_round(cfg, encoded, round_id=setup.round_id, dropouts=drops, probe_size=probe)
    plain_seconds = time.perf_counter() - start
    assert plain.survivors == real.survivors and plain.total is not None
    assert real.total is not None and np.array_equal(plain.total, real.total)  # bit-exact
    s, m = real.stats, plain.stats
    extra = {}
    if unshared:  # every client verifies every signature itself, as real clients do
        alone = run_cohort_round(
            setup, encoded, round_id=setup.round_id, dropouts=drops, shared_checks=False
        )
        assert alone.total is not None and np.array_equal(alone.total, real.total)
        extra = {
            "unshared_round_s": round(alone.stats["seconds.total"], 3),
            "unshared_over_shared": round(alone.stats["seconds.total"] / s["seconds.total"], 2),
        }
    return {
        "n": n,
        "params": d,
        "k": int(s["k"]),
        "t": int(s["t"]),
        "dropped": len(drops),
        "survivors": len(real.survivors),
        "secure_round_s": round(s["seconds.total"], 3),
        "stages_s": {
            key[8:]: round(v, 3)
            for key, v in s.items()
            if key.startswith("seconds.") and key[8:] not in ("total", "clients", "server")
        },
        "clients_cpu_s": round(s["seconds.clients"], 3),
        "server_cpu_s": round(s["seconds.server"], 3),
        "client_s_per_client": round(s["seconds.clients"] / n, 4),
        "bytes_up_per_client": round(s["bytes_up_per_client"]),
        "bytes_down_per_client": round(s["bytes_down_per_client"]),
        "bytes_masked_per_client": round(s["bytes_masked_per_client"]),
        "cost_only_s": round(plain_seconds, 4),
        "secure_over_cost_only": round(s["seconds.total"] / plain_seconds, 1),
        "modelled_round_s": round(m["modelled.seconds_round"], 3),
        "modelled_over_measured_s": round(m["modelled.seconds_round"] / s["seconds.total"], 2),
        "modelled_over_measured_bytes_up": round(
            m["modelled.bytes_up_per_client"] / s["bytes_up_per_client"], 2
        ),
        "modelled_over_measured_bytes_down": round(
            m["modelled.bytes_down_per_client"] / s["bytes_down_per_client"], 2
        ),
        **extra,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[50, 100, 200])
    parser.add_argument("--params", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--probe", type=int, default=20)
    parser.add_argument(
        "--unshared", action="store_true", help="also time the round without shared verification"
    )
    args = parser.parse_args()
    cfg = SecureAggregationConfig(scheme="secagg+")
    rows = [
        row(cfg, n, d, args.dropout, args.probe, args.unshared)
        for d in args.params
        for n in args.sizes
    ]
    print(
        json.dumps(
            {
                "benchmark": "secagg_in_process",
                "scheme": "secagg+ (derived k, t; corrupt 0.2, dropout 0.1)",
                "modulus_bits": cfg.modulus_bits,
                "probe_clients": args.probe,
                "rows": rows,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
