"""Flower's SecAgg+ driven in-process for ``benchmarks/secagg.py``: prints one JSON object.

Runs in a separate virtualenv that has ``flwr`` (never a dependency of this project) and
imports only ``flwr``, ``numpy`` and the standard library. It runs one round of Flower's
SecAgg+ by calling the protocol *functions* Flower's client mod
(``flwr/client/mod/secure_aggregation/secaggplus_mod.py``) and server workflow
(``flwr/server/workflow/secure_aggregation/secaggplus_workflow.py``) call, in the same
order, without the Flower runtime (no gRPC, messages, records or state serialisation):

* setup: each client generates two SECP384R1 key pairs, serialised as PEM (``pk1`` for the
  pairwise masks, ``pk2`` for encrypting shares); the server shuffles the node ids and links
  each to the ``num_shares >> 1`` nodes on either side of it on the ring (itself included);
* share keys: each client draws a 32-byte self-mask seed, Shamir-shares it and its PEM ``sk1``
  (``create_shares``: pycryptodome over GF(2^128) in 16-byte chunks) into ``num_shares``
  shares, keeps its own share and Fernet-encrypts one for each neighbour under an ECDH+HKDF
  key;
* collect masked vectors: each surviving client decrypts the shares it was forwarded,
  weights, quantizes (``quantize``), prepends the weight factor, adds the self mask and
  the pairwise masks (``pseudo_rand_gen``) and reduces mod ``modulus_range``; the server
  deserializes (``bytes_to_ndarray``) and sums the vectors;
* unmask: each survivor sends the self-mask-seed shares of its active neighbours and the
  ``sk1`` shares of its dropped ones; the server combines the shares (``combine_shares``) and
  removes the masks, then dequantizes.

Clients listed in ``--dropped`` (indices ``0..n-1``) drop after sharing their keys, before
sending a masked vector. The inputs are the same as on our side: client ``i``'s update is
``numpy.random.default_rng([seed, i]).uniform(-1, 1, d)`` cast to float32.

Usage: python secagg_flower_driver.py --n 10 --d 100000 --num-shares 10 --threshold 5
       --dropped 9 [--seed 0] [--round-seed 0] [--prg-repeats 3]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

try:
    import flwr
    from flwr.common import bytes_to_ndarray, ndarray_to_bytes
    from flwr.common.secure_aggregation.crypto.shamir import combine_shares, create_shares
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import (
        decrypt,
        encrypt,
        generate_shared_key,
    )
    from flwr.common.secure_aggregation.ndarrays_arithmetic import (
        factor_combine,
        factor_extract,
        get_parameters_shape,
        parameters_addition,
        parameters_mod,
        parameters_multiply,
        parameters_subtraction,
    )
    from flwr.common.secure_aggregation.quantization import dequantize, quantize
    from flwr.common.secure_aggregation.secaggplus_utils import (
        pseudo_rand_gen,
        share_keys_plaintext_concat,
        share_keys_plaintext_separate,
    )
    from flwr.supercore.primitives.asymmetric import (
        bytes_to_private_key,
        bytes_to_public_key,
        generate_key_pairs,
        private_key_to_bytes,
        public_key_to_bytes,
    )
except ImportError as exc:  # pragma: no cover - reported to the caller as JSON
    if not {"-h", "--help"} & set(sys.argv[1:]):  # --help needs no Flower
        print(json.dumps({"error": f"cannot import Flower's SecAgg+ functions: {exc}"}))
        sys.exit(2)

ID_BYTES = 8  # node ids (uint64) and int list entries are counted as 8 bytes on the wire


def update_for(seed: int, index: int, d: int) -> np.ndarray:
    """Client ``index``'s update: the same function as in ``benchmarks/secagg.py``."""
    rng = np.random.default_rng([seed, index])
    return rng.uniform(-1.0, 1.0, d).astype(np.float32)


@dataclass
class ClientState:
    """What Flower's ``SecAggPlusState`` holds for one client between stages."""

    nid: int
    sk1: bytes = b""
    pk1: bytes = b""
    sk2: bytes = b""
    pk2: bytes = b""
    rd_seed: bytes = b""
    rd_seed_share_dict: dict[int, bytes] = field(default_factory=dict)
    sk1_share_dict: dict[int, bytes] = field(default_factory=dict)
    ss2_dict: dict[int, bytes] = field(default_factory=dict)
    public_keys_dict: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)


@dataclass(frozen=True)
class Settings:
    """The round's SecAgg+ configuration (what the workflow sends in its setup stage)."""

    num_shares: int
    threshold: int
    clipping_range: float
    target_range: int
    mod_range: int
    max_weight: float


def client_setup(state: ClientState) -> int:
    """Stage 0 of the mod: two key pairs; returns the bytes sent (both PEM public keys)."""
    sk1, pk1 = generate_key_pairs()
    sk2, pk2 = generate_key_pairs()
    state.sk1, state.pk1 = private_key_to_bytes(sk1), public_key_to_bytes(pk1)
    state.sk2, state.pk2 = private_key_to_bytes(sk2), public_key_to_bytes(pk2)
    return len(state.pk1) + len(state.pk2)


def client_share_keys(
    state: ClientState, cfg: Settings, keys: dict[int, tuple[bytes, bytes]]
) -> tuple[list[int], list[bytes]]:
    """Stage 1 of the mod: share the self-mask seed and ``sk1``, encrypt for each neighbour."""
    state.public_keys_dict = keys
    if len(keys) < cfg.threshold:
        raise ValueError("Available neighbours number smaller than threshold")
    pk_list = [pk for pair in keys.values() for pk in pair]
    if len(set(pk_list)) != len(pk_list):
        raise ValueError("Some public keys are identical")
    if keys[state.nid] != (state.pk1, state.pk2):
        raise ValueError("Own public keys are displayed in dict incorrectly")
    state.rd_seed = os.urandom(32)
    b_shares = create_shares(state.rd_seed, cfg.threshold, cfg.num_shares)
    sk1_shares = create_shares(state.sk1, cfg.threshold, cfg.num_shares)
    dsts: list[int] = []
    ciphertexts: list[bytes] = []
    for idx, (nid, (_, pk2)) in enumerate(keys.items()):
        if nid == state.nid:
            state.rd_seed_share_dict[nid] = b_shares[idx]
            state.sk1_share_dict[nid] = sk1_shares[idx]
            continue
        shared_key = generate_shared_key(bytes_to_private_key(state.sk2), bytes_to_public_key(pk2))
        state.ss2_dict[nid] = shared_key
        plaintext = share_keys_plaintext_concat(state.nid, nid, b_shares[idx], sk1_shares[idx])
        dsts.append(nid)
        ciphertexts.append(encrypt(shared_key, plaintext))
    return dsts, ciphertexts


def client_masked_vector(
    state: ClientState,
    cfg: Settings,
    srcs: list[int],
    ciphertexts: list[bytes],
    update: np.ndarray,
    num_examples: int,
) -> list[np.ndarray]:
    """Stage 2 of the mod: store the shares, then weight, quantize and mask the update."""
    if len(ciphertexts) + 1 < cfg.threshold:
        raise ValueError("Not enough available neighbour clients.")
    available: list[int] = []
    for src, ciphertext in zip(srcs, ciphertexts, strict=True):
        plaintext = decrypt(state.ss2_dict[src], ciphertext)
        actual_src, dst, rd_seed_share, sk1_share = share_keys_plaintext_separate(plaintext)
        available.append(src)
        if actual_src != src or dst != state.nid:
            raise ValueError("share addressed to the wrong parties")
        state.rd_seed_share_dict[src] = rd_seed_share
        state.sk1_share_dict[src] = sk1_share
    q_ratio = round(num_examples / cfg.max_weight * cfg.target_range)
    dq_ratio = q_ratio / cfg.target_range
    parameters = parameters_multiply([update], dq_ratio)
    quantized = quantize(parameters, cfg.clipping_range, cfg.target_range)
    quantized = factor_combine(q_ratio, quantized)
    dims = [a.shape for a in quantized]
    quantized = parameters_addition(quantized, pseudo_rand_gen(state.rd_seed, cfg.mod_range, dims))
    for node_id in available:
        shared_key = generate_shared_key(
            bytes_to_private_key(state.sk1),
            bytes_to_public_key(state.public_keys_dict[node_id][0]),
        )
        pairwise = pseudo_rand_gen(shared_key, cfg.mod_range, dims)
        if state.nid > node_id:
            quantized = parameters_addition(quantized, pairwise)
        else:
            quantized = parameters_subtraction(quantized, pairwise)
    masked: list[np.ndarray] = parameters_mod(quantized, cfg.mod_range)
    return masked


def server_unmask(
    cfg: Settings,
    masked_sum: list[np.ndarray],
    sampled: set[int],
    active: set[int],
    neighbours: dict[int, set[int]],
    public_keys: dict[int, tuple[bytes, bytes]],
    responses: list[tuple[list[int], list[bytes]]],
) -> tuple[list[np.ndarray], int]:
    """The workflow's unmask stage up to the unmasked sum; returns it and the PRG count."""
    collected: dict[int, list[bytes]] = {nid: [] for nid in sampled}
    for nids, shares in responses:
        for owner, share in zip(nids, shares, strict=True):
            collected[owner].append(share)
    vector = masked_sum
    expansions = 0
    for nid, share_list in collected.items():
        if len(share_list) < cfg.threshold:
            raise RuntimeError("Not enough shares to recover secret in unmask vectors stage")
        secret = combine_shares(share_list)
        if nid in active:
            private_mask = pseudo_rand_gen(secret, cfg.mod_range, get_parameters_shape(vector))
            vector = parameters_subtraction(vector, private_mask)
            expansions += 1
            continue
        for other in sorted(neighbours[nid] - {nid}):
            shared_key = generate_shared_key(
                bytes_to_private_key(secret), bytes_to_public_key(public_keys[other][0])
            )
            pairwise = pseudo_rand_gen(shared_key, cfg.mod_range, get_parameters_shape(vector))
            expansions += 1
            if nid > other:
                vector = parameters_addition(vector, pairwise)
            else:
                vector = parameters_subtraction(vector, pairwise)
    unmasked: list[np.ndarray] = parameters_mod(vector, cfg.mod_range)
    return unmasked, expansions


def run_round(args: argparse.Namespace) -> dict[str, Any]:
    """One SecAgg+ round; times each party's work, counts the bytes each client sends."""
    n, d = args.n, args.d
    cfg = Settings(
        num_shares=args.num_shares,
        threshold=args.threshold,
        clipping_range=args.clipping_range,
        target_range=args.quantization_range,
        mod_range=args.modulus_range,
        max_weight=1.0,
    )
    num_examples = 1  # every client weighs 1 (FedAvg on equal weights)
    node_ids = [i + 1 for i in range(n)]
    dropped = {node_ids[i] for i in args.dropped}
    survivors = [nid for nid in node_ids if nid not in dropped]

    # server, setup: the ring of num_shares // 2 neighbours on each side, itself included
    order = list(node_ids)
    random.Random(args.round_seed).shuffle(order)
    half = cfg.num_shares >> 1
    neighbours = {
        nid: {order[(idx + off) % n] for off in range(-half, half + 1)}
        for idx, nid in enumerate(order)
    }
    states = {nid: ClientState(nid) for nid in node_ids}
    sent: dict[int, dict[str, int]] = {nid: {} for nid in node_ids}
    setup_s: list[float] = []
    for nid in node_ids:
        t0 = time.perf_counter()
        sent[nid]["public_keys"] = client_setup(states[nid])
        setup_s.append(time.perf_counter() - t0)
    public_keys = {nid: (states[nid].pk1, states[nid].pk2) for nid in node_ids}

    # share keys: each client gets its neighbours' public keys (itself included)
    active = set(node_ids)
    share_s: list[float] = []
    forward: dict[int, tuple[list[int], list[bytes]]] = {nid: ([], []) for nid in node_ids}
    for nid in node_ids:
        keys = {v: public_keys[v] for v in neighbours[nid] & active}
        t0 = time.perf_counter()
        dsts, ciphertexts = client_share_keys(states[nid], cfg, keys)
        share_s.append(time.perf_counter() - t0)
        sent[nid]["shares"] = ID_BYTES * len(dsts) + sum(len(c) for c in ciphertexts)
        sent[nid]["num_shares_sent"] = len(ciphertexts)
        for dst, ciphertext in zip(dsts, ciphertexts, strict=True):
            forward[dst][0].append(nid)
            forward[dst][1].append(ciphertext)

    # collect masked vectors: the dropped clients send nothing from here on
    mask_s: list[float] = []
    serialize_s: list[float] = []
    collect_s = 0.0
    masked_sum: list[np.ndarray] | None = None
    truth = np.zeros(d, dtype=np.float64)
    for i, nid in enumerate(node_ids):
        if nid in dropped:
            continue
        update = update_for(args.seed, i, d)
        truth += np.clip(update.astype(np.float64), -cfg.clipping_range, cfg.clipping_range)
        srcs, ciphertexts = forward[nid]
        t0 = time.perf_counter()
        vector = client_masked_vector(states[nid], cfg, srcs, ciphertexts, update, num_examples)
        t1 = time.perf_counter()
        wire = [ndarray_to_bytes(a) for a in vector]
        t2 = time.perf_counter()
        mask_s.append(t1 - t0)
        serialize_s.append(t2 - t1)
        sent[nid]["masked_vector"] = sum(len(b) for b in wire)
        del vector
        t0 = time.perf_counter()
        received = [bytes_to_ndarray(b) for b in wire]
        masked_sum = received if masked_sum is None else parameters_addition(masked_sum, received)
        collect_s += time.perf_counter() - t0
        del wire, received
    assert masked_sum is not None
    t0 = time.perf_counter()
    masked_sum = parameters_mod(masked_sum, cfg.mod_range)
    collect_s += time.perf_counter() - t0
    active = set(survivors)
    dead = set(node_ids) - active

    # unmask: each survivor reveals b shares of active and sk1 shares of dead neighbours
    responses: list[tuple[list[int], list[bytes]]] = []
    for nid in survivors:
        act, ded = list(neighbours[nid] & active), list(neighbours[nid] & dead)
        if len(act) < cfg.threshold:
            raise RuntimeError("Available neighbours number smaller than threshold")
        shares = [states[nid].rd_seed_share_dict[v] for v in act]
        shares += [states[nid].sk1_share_dict[v] for v in ded]
        responses.append((act + ded, shares))
        sent[nid]["unmask_response"] = ID_BYTES * len(shares) + sum(len(s) for s in shares)
    t0 = time.perf_counter()
    unmasked, expansions = server_unmask(
        cfg, masked_sum, set(node_ids), active, neighbours, public_keys, responses
    )
    unmask_s = time.perf_counter() - t0

    # dequantize as the workflow does (the weighted mean), and check against the plain mean
    t0 = time.perf_counter()
    q_total, params = factor_extract(unmasked)
    mean = dequantize(params, cfg.clipping_range, cfg.target_range)[0]
    mean += -(len(active) - 1) * cfg.clipping_range
    mean *= cfg.target_range / q_total
    decode_s = time.perf_counter() - t0
    error = float(np.max(np.abs(mean - truth / len(active))))

    totals = [sum(v for k, v in sent[nid].items() if k != "num_shares_sent") for nid in survivors]
    one = sent[survivors[0]]
    return {
        "n": n,
        "d": d,
        "survivors": len(survivors),
        "dropped": len(dropped),
        "neighbourhood_size_incl_self": len(neighbours[node_ids[0]]),
        "client_setup_s": setup_s,
        "client_share_keys_s": share_s,
        "client_mask_s": mask_s,
        "client_serialize_s": serialize_s,
        "server_collect_s": collect_s,
        "server_unmask_s": unmask_s,
        "server_decode_s": decode_s,
        "server_prg_expansions": expansions,
        "client_prg_expansions": 1 + len(forward[survivors[0]][0]),
        "masked_vector_dtype": str(masked_sum[1].dtype),
        "bytes_per_client": {
            "public_keys": one["public_keys"],
            "shares": one["shares"],
            "masked_vector": one["masked_vector"],
            "unmask_response": one["unmask_response"],
            "total_median": statistics.median(totals),
            "total_without_unmask_median": statistics.median(
                t - sent[nid]["unmask_response"] for t, nid in zip(totals, survivors, strict=True)
            ),
        },
        "max_abs_error_of_mean": error,
        "quantization_step": 2 * cfg.clipping_range / cfg.target_range,
    }


def prg_time(d: int, mod_range: int, repeats: int) -> float:
    """Median time of one ``pseudo_rand_gen`` expansion of ``d`` values."""
    times = []
    for _ in range(repeats):
        seed = os.urandom(32)
        t0 = time.perf_counter()
        pseudo_rand_gen(seed, mod_range, [(d,)])
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def quantize_time(cfg: Settings, update: np.ndarray, repeats: int) -> float:
    """Median time of the mod's weighting + ``quantize`` + ``factor_combine`` of one update."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        q_ratio = round(1 / cfg.max_weight * cfg.target_range)
        parameters = parameters_multiply([update], q_ratio / cfg.target_range)
        factor_combine(q_ratio, quantize(parameters, cfg.clipping_range, cfg.target_range))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def pairwise_seed_check(samples: int = 32) -> dict[str, Any]:
    """What the pairwise-mask seeds look like: ``generate_shared_key`` outputs, as used."""
    keys = []
    for _ in range(samples):
        sk, _ = generate_key_pairs()
        _, pk = generate_key_pairs()
        keys.append(generate_shared_key(sk, pk))
    ascii_only = all(max(k) < 0x80 for k in keys)
    return {
        "seed_lengths": sorted({len(k) for k in keys}),
        "all_bytes_ascii": ascii_only,
        "note": (
            "the seed is base64url text: every byte has bit 7 clear, so the XOR fold leaves "
            "bits 7, 15, 23, 31 of seed32 at 0 (at most 28 free bits)"
            if ascii_only
            else "some seed bytes are not ASCII"
        ),
    }


def main() -> None:
    """Parse the arguments, run one round, print JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, required=True)
    parser.add_argument("--d", type=int, required=True)
    parser.add_argument("--num-shares", type=int, required=True)
    parser.add_argument("--threshold", type=int, required=True)
    parser.add_argument("--dropped", type=lambda s: [int(x) for x in s.split(",") if x], default=[])
    parser.add_argument("--seed", type=int, default=0, help="input data seed")
    parser.add_argument("--round-seed", type=int, default=0, help="ring shuffle seed")
    parser.add_argument("--clipping-range", type=float, default=1.0)
    parser.add_argument("--quantization-range", type=int, default=2**22)
    parser.add_argument("--modulus-range", type=int, default=2**32)
    parser.add_argument("--prg-repeats", type=int, default=5)
    args = parser.parse_args()
    out = run_round(args)
    out["prg_expansion_s"] = prg_time(args.d, args.modulus_range, args.prg_repeats)
    cfg = Settings(
        args.num_shares,
        args.threshold,
        args.clipping_range,
        args.quantization_range,
        args.modulus_range,
        1.0,
    )
    update = update_for(args.seed, 0, args.d)
    out["quantize_s"] = quantize_time(cfg, update, args.prg_repeats)
    out["pairwise_seed_check"] = pairwise_seed_check()
    source = inspect.getsource(pseudo_rand_gen)
    out["prg_source_check"] = {
        "uses_numpy_randomstate": "np.random.RandomState(" in source,
        "folds_seed_to_32_bits": "seed32 ^=" in source,
    }
    out["flwr_version"] = getattr(flwr, "__version__", "unknown")
    out["numpy_version"] = np.__version__
    out["python"] = sys.version.split()[0]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
