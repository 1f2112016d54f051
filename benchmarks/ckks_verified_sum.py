"""What a CKKS decryptor pays to decrypt only a sum it checked, and what the flooding costs.

Before: the server sent a decryptor its encrypted sum (one update's size); the decryptor
decrypted it. Now: the server sends the survivors' signed uploads; the decryptor verifies
each Ed25519 signature, parses and sums the ciphertexts itself, decrypts and floods the
output with Gaussian noise (``privacy/ckks/flooding.py``). For ``n`` clients and ``d``
float32 parameters this prints, as JSON, medians over ``--repeats``:

* ``bundle_bytes`` / ``sum_bytes``: what a decryptor receives (n uploads vs one sum);
* ``decryptor_s`` (verify + sum + decrypt + flood) vs ``decrypt_only_s`` (decrypt the
  server's sum, as before), and their ratio;
* ``server_upload_s`` (parse + signature + ciphertext checks per upload) vs
  ``server_add_s`` (parse + add per upload, as before); ``sign_s`` per client;
* ``flooding_std`` and the flooded sum's ``max_abs_error`` / ``rms_error`` against the exact
  float64 sum of the updates (the noise at ``ckks_flooding_bits = 40``, scale ``2^100``;
  the updates are float64 so that the noise is not rounded away), and the share of values
  it changes once cast to float32.

Usage: python benchmarks/ckks_verified_sum.py [--clients 5 10 20] [--params 100000]
       [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tenseal as ts  # noqa: E402
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey  # noqa: E402

from fl_secure.messages import TensorSpec  # noqa: E402
from privacy.ckks.aggregator import CkksAggregator  # noqa: E402
from privacy.ckks.context import make_secret_context, public_context  # noqa: E402
from privacy.ckks.encryption import decrypt_sum, encrypt_update  # noqa: E402
from privacy.ckks.flooding import flooding_std  # noqa: E402
from privacy.ckks.round_setup import CkksSetup  # noqa: E402
from privacy.ckks.signed import SignedUpload, encode_bundle  # noqa: E402
from privacy.ckks.update import EncryptedUpdate  # noqa: E402
from privacy.ckks.verified_sum import verified_sum  # noqa: E402


def _median(runs: int, work: Callable[[], Any]) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(runs):
        start = time.perf_counter()
        out = work()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def measure(n: int, d: int, repeats: int, secret: bytes) -> dict[str, Any]:
    """One configuration: n clients, d float32 parameters."""
    public = public_context(secret)
    specs = [TensorSpec("w", np.dtype(np.float64), (d,))]  # float64: the noise stays visible
    ids = [f"client-{i}" for i in range(n)]
    keys = {c: Ed25519PrivateKey.generate() for c in ids}
    registry = {c: k.public_key() for c, k in keys.items()}
    setup = CkksSetup(secrets.token_bytes(16), tuple(ids), None, min_count=n)
    updates = [OrderedDict(w=np.random.default_rng([0, i]).normal(0, 1e-2, d)) for i in range(n)]
    raw = [encrypt_update(u, secret).to_bytes() for u in updates]
    rid = setup.round_id
    sign_s, _ = _median(repeats, lambda: SignedUpload.sign(keys[ids[0]], ids[0], rid, raw[0]))
    signed = [SignedUpload.sign(keys[c], c, rid, r) for c, r in zip(ids, raw, strict=True)]
    uploads = [s.to_bytes() for s in signed]

    def server_old() -> EncryptedUpdate:
        agg = CkksAggregator(public, specs)
        for r in raw:
            agg.add(EncryptedUpdate.from_bytes(r))
        return agg.result()

    def server_new() -> None:
        agg = CkksAggregator(public, specs)
        for u in uploads:
            s = SignedUpload.from_bytes(u)
            s.verify(registry)
            agg.check(EncryptedUpdate.from_bytes(s.update))

    old_s, total = _median(repeats, server_old)
    new_s, _ = _median(repeats, server_new)
    sum_bytes = total.to_bytes()
    bundle = encode_bundle(uploads)
    ctx = ts.context_from(secret)
    std = flooding_std(ctx, summed=n, ciphertexts=total.layout.num_ciphertexts, bits=40)

    def decrypt_only() -> Any:
        return decrypt_sum(EncryptedUpdate.from_bytes(sum_bytes), secret, specs=specs)

    def decryptor() -> Any:
        mine = verified_sum(bundle, setup=setup, public_ctx=public, specs=specs,
                            registry=registry, own=signed[0], min_clients=n)  # fmt: skip
        return decrypt_sum(mine, secret, specs=specs, flooding_std=std)

    before_s, _ = _median(repeats, decrypt_only)
    after_s, flooded = _median(repeats, decryptor)
    unflooded = decrypt_only()["w"]
    exact = np.sum([u["w"] for u in updates], axis=0)
    error = flooded["w"] - exact
    return {
        "clients": n,
        "params": d,
        "ciphertexts": total.layout.num_ciphertexts,
        "sum_bytes": len(sum_bytes),
        "bundle_bytes": len(bundle),
        "bundle_over_sum": round(len(bundle) / len(sum_bytes), 2),
        "decrypt_only_s": round(before_s, 4),
        "decryptor_s": round(after_s, 4),
        "decryptor_ratio": round(after_s / before_s, 2),
        "server_add_s_per_upload": round(old_s / n, 5),
        "server_upload_s_per_upload": round(new_s / n, 5),
        "sign_s": round(sign_s, 5),
        "flooding_std": std,
        "max_abs_error": float(np.abs(error).max()),
        "rms_error": float(np.sqrt(np.mean(error**2))),
        "unflooded_max_abs_error": float(np.abs(unflooded - exact).max()),
        # cast to float32 (the usual layer dtype): the share of values the noise changes
        "float32_values_changed_by_flooding": float(
            np.mean(flooded["w"].astype(np.float32) != unflooded.astype(np.float32))
        ),
    }


def main() -> None:
    """Run the configurations and print one JSON document."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[5, 10, 20])
    parser.add_argument("--params", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    secret = make_secret_context()
    rows = [measure(n, args.params, args.repeats, secret) for n in args.clients]
    print(json.dumps({"benchmark": "ckks_verified_sum", "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
