"""``fl-secure`` with a recorder for the chaos benchmark (``benchmarks/chaos.py``).

Runs ``python -m fl_secure.app.cli ARGS`` after wrapping two functions, so that the benchmark
can check every unmasked sum exactly without any hook in the product:

- a client writes the integer vector it masks (its clipped, noised, encoded update) to
  ``$CHAOS_RECORD/inputs/<round id>/<client>.npy`` before masking it;
- the server writes each sum it unmasks (mod ``2^bits``), with its survivors, round and
  attempt, to ``$CHAOS_RECORD/sums/<round id>.json`` and ``.npy``.

Files are written to a temporary name and renamed: a kill -9 leaves whole files or none.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _save(path: Path, array: np.ndarray, meta: dict[str, Any] | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    with tmp.open("wb") as handle:
        np.save(handle, array)
    os.replace(tmp, path.with_suffix(".npy"))
    if meta is not None:
        tmp.write_text(json.dumps(meta))
        os.replace(tmp, path.with_suffix(".json"))


def install(record: Path) -> None:
    """Wrap the client's masking and the server's unmasking to record what they saw."""
    from privacy.secagg.client import SecAggClient
    from privacy.secagg.server_round import ServerSecureRound
    from server.secure_relay import SecureRelay

    masked_input = SecAggClient.masked_input

    def recording_masked_input(self: Any, shares: Any, update: Any, *, encoded: Any = None) -> Any:
        if encoded is not None:
            name = f"inputs/{self.config.round_id.hex()}/{self.client_id}"
            _save(record / name, np.asarray(encoded))
        return masked_input(self, shares, update, encoded=encoded)

    SecAggClient.masked_input = recording_masked_input  # type: ignore[method-assign]

    start = SecureRelay.start

    def recording_start(self: Any, number: int, attempt: int, cohort: list[str]) -> Any:
        secure = start(self, number, attempt, cohort)
        secure.chaos_round = (number, attempt)
        return secure

    SecureRelay.start = recording_start  # type: ignore[method-assign]
    decode = ServerSecureRound._decode

    def recording_decode(self: Any, total: np.ndarray) -> np.ndarray:
        number, attempt = getattr(self, "chaos_round", (-1, -1))
        meta = {
            "round": number,
            "attempt": attempt,
            "survivors": sorted(self.server.survivors),
            "modulus_bits": self.setup.modulus_bits,
            "server_pid": os.getpid(),
        }
        _save(record / "sums" / self.setup.round_id.hex(), np.asarray(total), meta)
        return decode(self, total)

    ServerSecureRound._decode = recording_decode  # type: ignore[method-assign]


if __name__ == "__main__":
    install(Path(os.environ["CHAOS_RECORD"]))
    from fl_secure.app.cli.console import main

    sys.exit(main(sys.argv[1:]))
