"""Fuzz benchmark of the gRPC servicer: prints one JSON object.

Sends ``--messages`` Hypothesis-drawn hostile messages (``tests/server/fuzz_messages.py``:
every RPC, structurally valid messages with hostile values and raw random bytes) to the
servicer of a real coordinator with secure aggregation configured, each against a freshly
posted attempt (``tests/server/fuzz_harness.py``), straight through the servicer's methods;
then ``--transport-messages`` more over gRPC + mutual TLS on loopback; then one honest
secure round on the same server.

Counts:

- crashes: calls answered UNKNOWN or INTERNAL (a server fault, not the message's), or whose
  handler raised (gRPC's own error log, over the transport);
- hangs: calls still running ``--hang-timeout`` seconds after their attempt closed (a call
  that waits for its stage is let wait ``--round-wait`` seconds, then its attempt is closed
  as the driver closes one at its deadline);
- traces: refused uploads that changed what the attempt received or aggregated;
- the status histogram (``RPC:STATUS``; UNDECODABLE: bytes that are no message of the RPC,
  refused by gRPC's deserializer before the servicer), messages/s;
- honest_round: the round after the fuzz completed with the exact mean of the honest updates.

Usage: python benchmarks/fuzz_servicer.py [--messages 100000] [--transport-messages 2000]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.server.fuzz_harness import KINDS, FuzzServer, Tally, honest_round  # noqa: E402
from tests.server.fuzz_messages import CLIENTS, messages  # noqa: E402

PER_ATTEMPT = 4  # messages sent against each posted attempt


class TimeUp(Exception):  # noqa: N818
    """``--max-minutes`` passed: stop drawing."""


def fuzz(
    server: FuzzServer, count: int, *, transport: bool, rng_seed: int, max_seconds: float = 0.0
) -> dict[str, Any]:
    """Send ``count`` messages (fewer if ``max_seconds`` pass first); the tally as a dict."""
    tally = Tally()
    traces: list[str] = []
    examples = math.ceil(count / PER_ATTEMPT)
    stop_at = time.monotonic() + max_seconds if max_seconds > 0 else math.inf

    @seed(rng_seed)
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(
        kind=st.sampled_from(KINDS),
        calls=st.lists(messages(), min_size=PER_ATTEMPT, max_size=PER_ATTEMPT),
    )
    def one_attempt(kind: str, calls: list[Any]) -> None:
        if tally.calls >= count:
            return
        if time.monotonic() > stop_at:
            raise TimeUp
        if tally.calls % 5000 < PER_ATTEMPT:
            print(f"{tally.calls} messages", file=sys.stderr, flush=True)
        scene = server.post_attempt(kind)
        for call in calls[: count - tally.calls]:
            outcome = server.run(call, scene, transport=transport)
            tally.add(call, outcome)
            if not server.refused_upload_left_no_trace(call, outcome):
                traces.append(repr(call))

    errors_before = len(server.errors.records)
    start = time.monotonic()
    try:
        one_attempt()
    except TimeUp:
        pass
    seconds = time.monotonic() - start
    server_errors = server.errors.records[errors_before:]
    totals: Counter[str] = Counter()
    for key, n in tally.statuses.items():
        totals[key.split(":", 1)[1]] += n
    return {
        "messages": tally.calls,
        "seconds": round(seconds, 1),
        "messages_per_s": round(tally.calls / seconds, 1),
        "crashes": len(tally.crashes) + len(server_errors),
        "hangs": len(tally.hangs),
        "traces": len(traces),
        "slowest_call_s": round(tally.slowest, 3),
        "statuses": dict(sorted(totals.items())),
        "histogram": dict(sorted(tally.statuses.items())),
        "first_crashes": (tally.crashes + server_errors)[:5],
        "first_hangs": tally.hangs[:5],
        "first_traces": traces[:5],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--transport-messages", type=int, default=2_000)
    parser.add_argument("--round-wait", type=float, default=0.3)
    parser.add_argument("--hang-timeout", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-minutes", type=float, default=0.0, help="stop the in-process part after this"
    )
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # every refusal is logged; the figures are what counts
    out: dict[str, Any] = {"args": vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        server = FuzzServer(Path(tmp), round_wait=args.round_wait, hang_timeout=args.hang_timeout)
        try:
            out["in_process"] = fuzz(
                server, args.messages, transport=False, rng_seed=args.seed,
                max_seconds=args.max_minutes * 60,
            )  # fmt: skip
            out["mtls"] = fuzz(
                server, args.transport_messages, transport=True, rng_seed=args.seed + 1
            )
            unchanged = all(
                server.coordinator.params[k].tobytes() == v.tobytes()
                for k, v in server.initial.items()
            )
            shifts = {c: 0.5 * (i + 1) for i, c in enumerate(CLIENTS)}
            status = honest_round(server, shifts)
            record = server.coordinator.run_dir.read_metrics()[-1]
            honest = sorted(record.get("clients", {}))  # whose updates made the round
            mean = np.float32(np.mean([shifts[c] for c in honest])) if honest else np.nan
            exact = all(
                np.array_equal(server.coordinator.params[k], v + mean)
                for k, v in server.initial.items()
            )
            out["honest_round"] = {
                "model_unchanged_by_the_fuzz": unchanged,
                "status": status,
                "updates": honest,
                "model_is_the_honest_mean": exact,
            }
        finally:
            server.close()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
