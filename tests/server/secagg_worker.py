"""A client process for the secure-aggregation process tests (not collected by pytest).

``python tests/server/secagg_worker.py --port P --id client-i --certs DIR --shift S [--die]``
joins the federation over gRPC + mTLS and sends ``S`` in every coordinate as its update.
With ``--die`` it writes ``DIR/../<id>.masked`` right after uploading its masked input and
then hangs, so that the test can ``kill -9`` it at exactly that point of the protocol. With
``--die-after-signing`` it goes on to sign the survivor set and receive the signatures
(the consistency check), then writes ``DIR/../<id>.signed`` and hangs before it reveals.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import privacy.secagg.client_round as session  # noqa: E402
from client.app import FlClient  # noqa: E402
from client.transport import Connection  # noqa: E402
from fl_secure.messages import LocalTraining, Tensors  # noqa: E402


class ShiftTrainer:
    def __init__(self, shift: float) -> None:
        self.shift, self.num_examples = shift, 5

    def train(self, shared: Tensors, training: LocalTraining):
        update = OrderedDict((k, np.full_like(v, self.shift)) for k, v in shared.items())
        return update, self.num_examples, {"train_loss": 1.0}

    def evaluate(self, shared: Tensors):
        return self.num_examples, {}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--id", required=True)
    parser.add_argument("--certs", type=Path, required=True)
    parser.add_argument("--shift", type=float, required=True)
    parser.add_argument("--die", action="store_true")
    parser.add_argument("--die-after-signing", action="store_true")
    args = parser.parse_args()
    if args.die_after_signing:
        from privacy.secagg.stages import CONSISTENCY

        real_round = session.client_secure_update
        signed = args.certs.parent / f"{args.id}.signed"

        def hang_after_signing(setup, client_id, identity, registry, exchange, compute, upload):
            def exchange_then_hang(stage: int, payload: bytes) -> bytes:
                reply = exchange(stage, payload)
                if stage == CONSISTENCY:
                    signed.write_text("signed")
                    while True:  # wait for SIGKILL
                        time.sleep(1)
                return reply

            return real_round(
                setup, client_id, identity, registry, exchange_then_hang, compute, upload
            )

        session.client_secure_update = hang_after_signing
    if args.die:
        real_upload_round = session.client_secure_update
        marker = args.certs.parent / f"{args.id}.masked"

        def hang_after_upload(setup, client_id, identity, registry, exchange, compute, upload):
            def upload_then_hang(vector: np.ndarray) -> None:
                upload(vector)
                marker.write_text("uploaded")
                while True:  # wait for SIGKILL
                    time.sleep(1)

            return real_upload_round(
                setup, client_id, identity, registry, exchange, compute, upload_then_hang
            )

        session.client_secure_update = hang_after_upload
    trainer = ShiftTrainer(args.shift)
    client = FlClient(
        Connection(f"localhost:{args.port}", args.id, cert_dir=args.certs),
        lambda reply: trainer,  # type: ignore[arg-type,return-value]
        max_wait=20.0,
    )
    client.run()


if __name__ == "__main__":
    main()
