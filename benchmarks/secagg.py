"""Secure-aggregation benchmark: our SecAgg+ vs Flower's SecAgg+, and our CKKS; prints JSON.

Our side (``privacy/secagg/``) runs in this process: one full round per repeat, driven
through the serialised messages like ``tests/privacy/secagg/test_protocol.py`` does. Flower's
side runs ``benchmarks/secagg_flower_driver.py`` under a separate interpreter that has ``flwr``
(``--flower-python``; Flower is never a dependency of this project), which calls Flower's
SecAgg+ functions in-process in the order its client mod and server workflow do. The two
sides alternate (ours first on even repeats, Flower first on odd ones) so both see the same
machine load; every figure is a median and every comparison a ratio ours / Flower.

Both sides get the same inputs and the same settings:

* client ``i``'s update is ``default_rng([seed, i]).uniform(-1, 1, d)`` as float32, clipped
  to ``[-1, 1]``; Flower quantizes to ``2^22`` levels over ``[-1, 1]``, we encode at scale
  ``2^21`` (the same step), both mod ``2^32``;
* SecAgg+ with ``k = min(n - 1, --k)`` neighbours and threshold ``t = k // 2 + 1``: ours
  with ``neighbours = k`` (or the complete graph when ``k = n - 1``), Flower with
  ``num_shares = k + 1`` (its neighbourhoods count the client itself: a ring of ``k / 2``
  nodes on either side, the same shape as our Harary graph for even ``k``) and
  ``reconstruction_threshold = t`` (Flower counts the share a client keeps of its own
  secrets towards ``t``; we share only with the ``k`` neighbours);
* 10% of the clients (evenly spread) drop after sharing their keys, before sending their
  masked input, so the server rebuilds their pairwise-mask keys.

Measured per configuration: per-client masking time (opening the received shares, encoding /
quantizing, self mask and pairwise masks; serialisation is reported apart), server unmasking
time (collecting the revealed shares, reconstruction, mask removal; the summing of masked
inputs is ``server_collect_s``), bytes a surviving client sends (our messages' ``to_bytes``
lengths; for Flower the PEM public keys, node ids as 8 bytes, Fernet ciphertexts of the
shares, the ``np.save`` bytes of the masked arrays and the revealed shares). For n = 10, our
CKKS aggregation (``privacy/ckks/``) is a third column: encryption per client, server
parse + add per update, decryption, bytes per client.
Our consistency round (Bonawitz et al.'s Round 3, :mod:`privacy.secagg.consistency`, with
``c = floor(0.2 n)``) is timed apart: each survivor's signature, the server's verification
and relay, and each client's unmasking including its check of the relayed signatures.

Usage: python benchmarks/secagg.py [--quick] [--flower-python PATH] [--repeats 7]
       [--large-repeats 5] [--k 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey  # noqa: E402

from fl_secure.messages import TensorSpec  # noqa: E402
from privacy.ckks.aggregator import CkksAggregator  # noqa: E402
from privacy.ckks.context import make_secret_context, public_context  # noqa: E402
from privacy.ckks.encryption import decrypt_sum, encrypt_update  # noqa: E402
from privacy.ckks.update import EncryptedUpdate  # noqa: E402
from privacy.secagg.client import SecAggClient  # noqa: E402
from privacy.secagg.config import SecAggConfig  # noqa: E402
from privacy.secagg.consistency import ConsistencySignature  # noqa: E402
from privacy.secagg.encoding import encode  # noqa: E402
from privacy.secagg.masks import prg_mask  # noqa: E402
from privacy.secagg.messages import (  # noqa: E402
    AdvertiseKeys,
    EncryptedShare,
    MaskedInput,
    UnmaskRequest,
    UnmaskResponse,
)
from privacy.secagg.server import SecAggServer  # noqa: E402

DRIVER = ROOT / "benchmarks" / "secagg_flower_driver.py"
DEFAULT_FLOWER_PYTHON = Path("/work/flwr-venv/bin/python")
CLIP = 1.0
QUANTIZATION_RANGE = 2**22  # Flower's default: levels over [-clip, clip]
SCALE = QUANTIZATION_RANGE / (2 * CLIP)  # ours: the same step, 2 * clip / 2^22
MODULUS_BITS = 32  # Flower's default modulus_range = 2^32
DROPOUT = 0.10
CORRUPT = 0.2  # the config's default corrupt_fraction: the consistency check's c
SEED = 0

PRG = {
    "ours": (
        "AES-256-CTR keystream (cryptography/OpenSSL), keyed by a 256-bit seed, IV 0, read "
        "as little-endian u32 words (u64 above 32 modulus bits) reduced mod 2^bits "
        "(privacy.secagg.masks.prg_mask / apply_keystreams). Self-mask seed b_u = "
        "secrets.token_bytes(32); pairwise seed s_uv = HKDF-SHA256 of an X25519 agreement, "
        "bound to the round id and both client ids. Stochastic rounding uniforms: AES-256-CTR "
        "keystream keyed by os.urandom (privacy.secagg.encoding.SecureUniform)."
    ),
    "flower": (
        "flwr.common.secure_aggregation.secaggplus_utils.pseudo_rand_gen: XOR-folds the seed "
        "bytes, 4 little-endian bytes at a time, into one 32-bit integer seed32 and draws "
        "numpy.random.RandomState(seed32).randint(0, num_range - 1, shape, dtype=int64): "
        "MT19937, not a cryptographic PRG, seed space 2^32 whatever the seed length, values "
        "in [0, num_range - 2] (randint's upper bound is exclusive). Self-mask seed rd_seed = "
        "os.urandom(32); pairwise seed = base64url(HKDF-SHA256(ECDH P-384 shared secret)), "
        "44 ASCII bytes, folded the same way. Stochastic rounding (quantization."
        "_stochastic_round): np.random.rand, the global unseeded MT19937."
    ),
    "ours_cryptographic": True,
    "flower_cryptographic": False,
}


@dataclass(frozen=True)
class Case:
    """One configuration: cohort size, vector length, graph degree, threshold, repeats."""

    n: int
    d: int
    k: int
    repeats: int

    @property
    def t(self) -> int:
        return self.k // 2 + 1

    @property
    def dropped(self) -> list[int]:
        m = max(1, round(DROPOUT * self.n))
        return sorted({int((j + 0.5) * self.n / m) for j in range(m)})

    @property
    def ours_neighbours(self) -> int:
        return 0 if self.k == self.n - 1 else self.k

    @property
    def flower_num_shares(self) -> int:
        return self.k + 1


def update_for(seed: int, index: int, d: int) -> np.ndarray:
    """Client ``index``'s update: the same function as in the Flower driver."""
    rng = np.random.default_rng([seed, index])
    out: np.ndarray = rng.uniform(-1.0, 1.0, d).astype(np.float32)
    return out


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


# --------------------------------------------------------------------------------------------
# Our SecAgg+


def run_ours(case: Case, repeat: int) -> dict[str, Any]:
    """One round of privacy.secagg: times each party's work, counts each client's bytes."""
    n, d = case.n, case.d
    cohort = tuple(f"client-{i:03d}" for i in range(n))
    config = SecAggConfig(
        round_id=f"bench-n{n}-d{d}-r{repeat}".encode(),
        cohort=cohort,
        threshold=case.t,
        clip_range=CLIP,
        scale=SCALE,
        neighbours=case.ours_neighbours,
        modulus_bits=MODULUS_BITS,
        corrupt=int(CORRUPT * n),
    )
    dropped = {cohort[i] for i in case.dropped}
    identities = {u: Ed25519PrivateKey.generate() for u in cohort}
    registry = {u: key.public_key() for u, key in identities.items()}
    server = SecAggServer(config, registry, d)
    sent: dict[str, dict[str, int]] = {u: {} for u in cohort}

    # Round 0: key advertisements (client construction generates the two X25519 key pairs)
    setup_s = []
    clients: dict[str, SecAggClient] = {}
    for u in cohort:
        t0 = time.perf_counter()
        clients[u] = SecAggClient(u, identities[u], config, registry, d)
        wire = clients[u].advertise_keys().to_bytes()
        setup_s.append(time.perf_counter() - t0)
        sent[u]["advert"] = len(wire)
        server.add_advert(AdvertiseKeys.from_bytes(wire))
    inboxes = server.route_adverts()

    # Round 1: encrypted shares
    share_s = []
    for u, inbox in inboxes.items():
        relayed = [AdvertiseKeys.from_bytes(a.to_bytes()) for a in inbox]
        t0 = time.perf_counter()
        shares = clients[u].share_keys(relayed)
        share_s.append(time.perf_counter() - t0)
        wires = [s.to_bytes() for s in shares]
        sent[u]["shares"] = sum(len(w) for w in wires)
        server.add_shares(u, [EncryptedShare.from_bytes(w) for w in wires])
    share_inboxes = server.route_shares()

    # Round 2: masked inputs (the dropped clients send nothing from here on)
    graph = server.graph
    mask_s, serialize_s, collect_s = [], [], 0.0
    truth = np.zeros(d, dtype=np.float64)
    client_prg = 0
    for i, u in enumerate(cohort):
        if u in dropped:
            continue
        update = update_for(SEED, i, d)
        truth += np.clip(update.astype(np.float64), -CLIP, CLIP)
        relayed_shares = [EncryptedShare.from_bytes(s.to_bytes()) for s in share_inboxes[u]]
        client_prg = 1 + len(relayed_shares)
        t0 = time.perf_counter()
        masked = clients[u].masked_input(relayed_shares, update)
        t1 = time.perf_counter()
        wire = masked.to_bytes()
        t2 = time.perf_counter()
        mask_s.append(t1 - t0)
        serialize_s.append(t2 - t1)
        sent[u]["masked_input"] = len(wire)
        del masked
        t0 = time.perf_counter()
        server.add_masked_input(MaskedInput.from_bytes(wire))
        collect_s += time.perf_counter() - t0
        del wire
    request = UnmaskRequest.from_bytes(server.unmask_request().to_bytes())

    # Round 3: consistency check (each survivor signs U3; the server verifies and relays)
    sign_s, server_check_s = [], 0.0
    for u in request.survivors:
        t0 = time.perf_counter()
        wire = clients[u].sign_survivors(request).to_bytes()
        sign_s.append(time.perf_counter() - t0)
        sent[u]["consistency_signature"] = len(wire)
        t0 = time.perf_counter()
        server.add_consistency(ConsistencySignature.from_bytes(wire))
        server_check_s += time.perf_counter() - t0
    t0 = time.perf_counter()
    relayed = [s.to_bytes() for s in server.route_signatures()]
    server_check_s += time.perf_counter() - t0
    received = sum(len(w) + 4 for w in relayed) + 4  # the packed list each signer receives
    signatures = [ConsistencySignature.from_bytes(w) for w in relayed]

    # Round 4: unmasking (each client first verifies the signatures: timed apart)
    responses, verify_s = [], []
    for u in request.survivors:
        t0 = time.perf_counter()
        response = clients[u].unmask(request, signatures)
        verify_s.append(time.perf_counter() - t0)
        wire = response.to_bytes()
        sent[u]["unmask_response"] = len(wire)
        responses.append(UnmaskResponse.from_bytes(wire))
    t0 = time.perf_counter()
    for response in responses:
        server.add_unmask_response(response)
    result = server.finish()
    unmask_s = time.perf_counter() - t0

    survivors = list(request.survivors)
    u3 = set(survivors)
    t0 = time.perf_counter()
    mean = config.decode(result, len(survivors)) / len(survivors)
    decode_s = time.perf_counter() - t0
    error = float(np.max(np.abs(mean - truth / len(survivors))))
    totals = {u: sum(sent[u].values()) for u in survivors}
    one = sent[survivors[0]]
    return {
        "survivors": len(survivors),
        "dropped": len(dropped),
        "client_setup_s": setup_s,
        "client_share_keys_s": share_s,
        "client_mask_s": mask_s,
        "client_serialize_s": serialize_s,
        "server_collect_s": collect_s,
        "server_unmask_s": unmask_s,
        "server_decode_s": decode_s,
        "client_consistency_sign_s": sign_s,
        "client_unmask_with_verify_s": verify_s,
        "server_consistency_s": server_check_s,
        "consistency_signatures": len(signatures),
        "consistency_bytes_received_per_client": received,
        "server_prg_expansions": len(u3) + sum(len(graph[u] & u3) for u in request.dropped),
        "client_prg_expansions": client_prg,
        "bytes_per_client": {
            "advert": one["advert"],
            "shares": one["shares"],
            "masked_input": one["masked_input"],
            "consistency_signature": one["consistency_signature"],
            "unmask_response": one["unmask_response"],
            "total_median": _median([float(v) for v in totals.values()]),
            "total_without_unmask_median": _median(
                [float(v - sent[u]["unmask_response"]) for u, v in totals.items()]
            ),
        },
        "max_abs_error_of_mean": error,
        "prg_expansion_s": ours_prg_s(d),
        "quantize_s": ours_encode_s(update_for(SEED, 0, d)),
    }


def ours_prg_s(d: int, repeats: int = 5) -> float:
    """Median time of one ``prg_mask`` expansion of ``d`` values (mod 2^32)."""
    times = []
    for _ in range(repeats):
        seed = os.urandom(32)
        t0 = time.perf_counter()
        prg_mask(seed, d, MODULUS_BITS)
        times.append(time.perf_counter() - t0)
    return _median(times)


def ours_encode_s(update: np.ndarray, repeats: int = 5) -> float:
    """Median time of :func:`privacy.secagg.encoding.encode` (AES-CTR stochastic rounding)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        encode(update, CLIP, SCALE, MODULUS_BITS)
        times.append(time.perf_counter() - t0)
    return _median(times)


# --------------------------------------------------------------------------------------------
# Flower's SecAgg+ (subprocess)


def probe_flower(python: Path | None) -> tuple[str | None, str | None]:
    """``(flwr version, None)`` if the interpreter can import flwr, else ``(None, reason)``."""
    if python is None:
        return None, f"no Flower interpreter: {DEFAULT_FLOWER_PYTHON} does not exist"
    if not python.exists():
        return None, f"Flower interpreter {python} does not exist"
    try:
        done = subprocess.run(
            [str(python), "-c", "import flwr, numpy; print(flwr.__version__)"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"cannot run {python}: {exc}"
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["(no output)"]
        return None, f"{python} cannot import flwr: {tail[0]}"
    return done.stdout.strip(), None


def run_flower(python: Path, case: Case, repeat: int) -> dict[str, Any]:
    """One round of Flower's SecAgg+ in the driver; its JSON, or ``{"error": ...}``."""
    cmd = [
        str(python),
        str(DRIVER),
        "--n",
        str(case.n),
        "--d",
        str(case.d),
        "--num-shares",
        str(case.flower_num_shares),
        "--threshold",
        str(case.t),
        "--dropped",
        ",".join(map(str, case.dropped)),
        "--seed",
        str(SEED),
        "--round-seed",
        str(repeat),
        "--clipping-range",
        str(CLIP),
        "--quantization-range",
        str(QUANTIZATION_RANGE),
        "--modulus-range",
        str(2**MODULUS_BITS),
    ]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    except subprocess.TimeoutExpired:
        return {"error": "the Flower driver timed out after 600 s"}
    lines = done.stdout.strip().splitlines()
    try:
        out: dict[str, Any] = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        out = {}
    if done.returncode != 0 or not out or "error" in out:
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        return {"error": out.get("error") or f"driver exit {done.returncode}: {tail}"}
    return out


# --------------------------------------------------------------------------------------------
# Our CKKS


def run_ckks(case: Case, encryptions: int) -> dict[str, Any]:
    """CKKS for the same d: encrypt ``encryptions`` clients, add one update per survivor.

    Encryption is timed on ``encryptions`` distinct clients; the server adds the survivors'
    updates reusing those ciphertexts round-robin (adding costs the same for any ciphertext).
    """
    d = case.d
    secret = make_secret_context()
    public = public_context(secret)
    survivors = [i for i in range(case.n) if i not in case.dropped]
    encrypt_s, serialize_s, blobs, updates = [], [], [], []
    for i in survivors[:encryptions]:
        update = update_for(SEED, i, d)
        t0 = time.perf_counter()
        encrypted = encrypt_update({"w": update}, secret)
        t1 = time.perf_counter()
        blobs.append(encrypted.to_bytes())
        serialize_s.append(time.perf_counter() - t1)
        encrypt_s.append(t1 - t0)
        updates.append(update)
    aggregator = CkksAggregator(public, [TensorSpec.of("w", updates[0])])
    add_s = []
    truth = np.zeros(d, dtype=np.float64)
    for j in range(len(survivors)):
        truth += updates[j % len(updates)]
        t0 = time.perf_counter()
        aggregator.add(EncryptedUpdate.from_bytes(blobs[j % len(blobs)]))
        add_s.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    mean = decrypt_sum(aggregator.result(), secret, divide_by=len(survivors))["w"]
    decrypt_s = time.perf_counter() - t0
    return {
        "client_encrypt_s": encrypt_s,
        "client_serialize_s": serialize_s,
        "server_add_s": add_s,
        "server_add_total_s": sum(add_s),
        "client_decrypt_s": decrypt_s,
        "bytes_per_client": len(blobs[0]),
        "max_abs_error_of_mean": float(np.max(np.abs(mean - truth / len(survivors)))),
    }


# --------------------------------------------------------------------------------------------
# Summary


def _side_summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over all rounds (client figures pool every client of every round)."""

    def pooled(key: str) -> float:
        return _median([x for r in rounds for x in r[key]])

    def per_round(key: str) -> float:
        return _median([float(r[key]) for r in rounds])

    last = rounds[-1]
    consistency = {}  # ours only: Flower's SecAgg+ has no consistency round
    if "client_consistency_sign_s" in last:
        consistency = {
            "client_consistency_sign_s_median": pooled("client_consistency_sign_s"),
            "client_unmask_with_verify_s_median": pooled("client_unmask_with_verify_s"),
            "server_consistency_s_median": per_round("server_consistency_s"),
            "consistency_signatures": last["consistency_signatures"],
            "consistency_bytes_received_per_client": last["consistency_bytes_received_per_client"],
        }
    return {
        **consistency,
        "rounds": len(rounds),
        "client_mask_s_median": pooled("client_mask_s"),
        "client_serialize_s_median": pooled("client_serialize_s"),
        "client_share_keys_s_median": pooled("client_share_keys_s"),
        "client_setup_s_median": pooled("client_setup_s"),
        "server_unmask_s_median": per_round("server_unmask_s"),
        "server_unmask_s_all": [r["server_unmask_s"] for r in rounds],
        "server_collect_s_median": per_round("server_collect_s"),
        "server_decode_s_median": per_round("server_decode_s"),
        "prg_expansion_s": per_round("prg_expansion_s"),
        "quantize_s": per_round("quantize_s"),
        "client_prg_expansions": last["client_prg_expansions"],
        "server_prg_expansions": last["server_prg_expansions"],
        "bytes_per_client": last["bytes_per_client"],
        "max_abs_error_of_mean": max(r["max_abs_error_of_mean"] for r in rounds),
    }


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b > 0 else None


def run_case(
    case: Case, flower: Path | None, ckks: bool, skip_reason: str | None = None
) -> dict[str, Any]:
    """All repeats of one configuration, alternating which side goes first."""
    ours: list[dict[str, Any]] = []
    theirs: list[dict[str, Any]] = []
    flower_error: str | None = None
    for r in range(case.repeats):
        order = ("ours", "flower") if r % 2 == 0 else ("flower", "ours")
        for side in order:
            if side == "ours":
                ours.append(run_ours(case, r))
            elif flower is not None and flower_error is None:
                out = run_flower(flower, case, r)
                if "error" in out:
                    flower_error = str(out["error"])
                else:
                    theirs.append(out)
    entry: dict[str, Any] = {
        "n": case.n,
        "d": case.d,
        "k": case.k,
        "t": case.t,
        "ours_neighbours_arg": case.ours_neighbours,
        "flower_num_shares": case.flower_num_shares,
        "flower_reconstruction_threshold": case.t,
        "dropped_indices": case.dropped,
        "repeats": case.repeats,
        "ours": _side_summary(ours),
    }
    if not theirs:
        reason = flower_error or skip_reason or "Flower interpreter not available"
        entry["flower"] = {"skipped": reason}
    else:
        f = _side_summary(theirs)
        f["masked_vector_dtype"] = theirs[-1]["masked_vector_dtype"]
        f["prg_source_check"] = theirs[-1]["prg_source_check"]
        f["pairwise_seed_check"] = theirs[-1]["pairwise_seed_check"]
        if flower_error is not None:
            f["error_in_a_later_repeat"] = flower_error
        entry["flower"] = f
        o = entry["ours"]
        mask_ratios = [
            _median(a["client_mask_s"]) / _median(b["client_mask_s"])
            for a, b in zip(ours, theirs, strict=False)
        ]
        unmask_ratios = [
            a["server_unmask_s"] / b["server_unmask_s"] for a, b in zip(ours, theirs, strict=False)
        ]
        mask_ratio = _ratio(o["client_mask_s_median"], f["client_mask_s_median"])
        unmask_ratio = _ratio(o["server_unmask_s_median"], f["server_unmask_s_median"])
        ratios = {
            "client_mask": mask_ratio,
            "client_mask_per_repeat": [round(x, 4) for x in mask_ratios],
            "server_unmask": unmask_ratio,
            "server_unmask_per_repeat": [round(x, 4) for x in unmask_ratios],
            "server_collect": _ratio(o["server_collect_s_median"], f["server_collect_s_median"]),
            "client_share_keys": _ratio(
                o["client_share_keys_s_median"], f["client_share_keys_s_median"]
            ),
            "client_serialize": _ratio(
                o["client_serialize_s_median"], f["client_serialize_s_median"]
            ),
            "prg_expansion": _ratio(o["prg_expansion_s"], f["prg_expansion_s"]),
            "encode_vs_quantize": _ratio(o["quantize_s"], f["quantize_s"]),
            "bytes_per_client": _ratio(
                o["bytes_per_client"]["total_median"], f["bytes_per_client"]["total_median"]
            ),
            "bytes_masked_vector": _ratio(
                o["bytes_per_client"]["masked_input"], f["bytes_per_client"]["masked_vector"]
            ),
        }
        entry["ratio_ours_over_flower"] = ratios
        mask_ok = mask_ratio is not None and mask_ratio <= 1.0
        unmask_ok = unmask_ratio is not None and unmask_ratio <= 1.0
        entry["goals"] = {
            "goal": "at least as fast as Flower while using a cryptographic PRG",
            "cryptographic_prg": PRG["ours_cryptographic"],
            "masking_at_least_as_fast": mask_ok,
            "unmasking_at_least_as_fast": unmask_ok,
            "met": bool(PRG["ours_cryptographic"] and mask_ok and unmask_ok),
        }
    if ckks:
        c = run_ckks(case, encryptions=2 if case.d >= 10**6 else 3)
        o = entry["ours"]
        entry["ckks"] = {
            "client_encrypt_s_median": _median(c["client_encrypt_s"]),
            "client_serialize_s_median": _median(c["client_serialize_s"]),
            "server_add_s_per_update_median": _median(c["server_add_s"]),
            "server_add_total_s": c["server_add_total_s"],
            "client_decrypt_s": c["client_decrypt_s"],
            "bytes_per_client": c["bytes_per_client"],
            "max_abs_error_of_mean": c["max_abs_error_of_mean"],
            "encryptions_timed": len(c["client_encrypt_s"]),
            "note": "server add = EncryptedUpdate.from_bytes + CkksAggregator.add per update",
            "ratio_ckks_over_ours": {
                "client_encrypt_vs_mask": _ratio(
                    _median(c["client_encrypt_s"]), o["client_mask_s_median"]
                ),
                "server_add_total_vs_collect_plus_unmask": _ratio(
                    c["server_add_total_s"],
                    o["server_collect_s_median"] + o["server_unmask_s_median"],
                ),
                "bytes_per_client": _ratio(
                    c["bytes_per_client"], o["bytes_per_client"]["total_median"]
                ),
            },
        }
    return entry


def main() -> None:
    """Parse the arguments, run every configuration, print one JSON object."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: n=10, d=1e4")
    parser.add_argument("--flower-python", type=Path, default=None)
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="rounds per configuration (default: 7; 2 with --quick)",
    )
    parser.add_argument(
        "--large-repeats", type=int, default=5, help="rounds for the largest (n=50, d=1e6)"
    )
    parser.add_argument("--k", type=int, default=20, help="neighbours when n - 1 > k (even)")
    args = parser.parse_args()
    if args.k % 2:
        parser.error("--k must be even (Flower's ring has k / 2 neighbours on either side)")

    flower = args.flower_python
    if flower is None and DEFAULT_FLOWER_PYTHON.exists():
        flower = DEFAULT_FLOWER_PYTHON
    flower_version, flower_reason = probe_flower(flower)
    if flower_reason is not None:
        flower = None

    if args.repeats is None:
        args.repeats = 2 if args.quick else 7

    def case(n: int, d: int, repeats: int) -> Case:
        return Case(n=n, d=d, k=min(n - 1, args.k), repeats=repeats)

    if args.quick:
        cases = [case(10, 10**4, args.repeats)]
    else:
        cases = [
            case(n, d, args.large_repeats if (n, d) == (50, 10**6) else args.repeats)
            for n in (10, 50)
            for d in (10**5, 10**6)
        ]
    started = time.perf_counter()
    results = [run_case(c, flower, ckks=c.n == 10, skip_reason=flower_reason) for c in cases]
    out = {
        "benchmark": "secagg",
        "quick": args.quick,
        "machine": {"cpus": os.cpu_count(), "load_average_at_start": os.getloadavg()},
        "settings": {
            "clip_range": CLIP,
            "ours_scale": SCALE,
            "flower_quantization_range": QUANTIZATION_RANGE,
            "modulus": f"2^{MODULUS_BITS}",
            "dropout": f"{DROPOUT:.0%} of n, after sharing keys, before the masked input",
            "k_rule": f"k = min(n - 1, {args.k}), t = k // 2 + 1; Flower num_shares = k + 1",
            "repeats": (
                f"{args.repeats} rounds (n=10, d=1e4: --quick)"
                if args.quick
                else f"{args.repeats} rounds per configuration, {args.large_repeats} for "
                "n=50, d=1e6 (runtime)"
            )
            + "; client medians pool every client of every round",
            "update": "default_rng([0, i]).uniform(-1, 1, d) as float32, weight 1",
            "order": "ours first on even repeats, Flower first on odd repeats",
        },
        "prg": PRG,
        "flower": {
            "python": str(flower) if flower else None,
            "version": flower_version,
            "skipped": flower_reason,
        },
        "configs": results,
        "total_runtime_s": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
