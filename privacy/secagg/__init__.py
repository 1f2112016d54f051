"""Secure aggregation (SecAgg and SecAgg+) as transport-free, message-based state machines.

Implements the single-server secure aggregation protocol of Bonawitz et al., "Practical Secure
Aggregation for Privacy-Preserving Machine Learning", CCS 2017 (SecAgg, Figure 4: rounds
*AdvertiseKeys*, *ShareKeys*, *MaskedInputCollection*, *Unmasking*), with the sparse
communication graph of Bell et al., "Secure Single-Server Aggregation with (Poly)Logarithmic
Overhead", CCS 2020 (SecAgg+): each client shares its secrets with, and masks against, only its
``k`` neighbours in a random ``k``-regular graph, with threshold ``t`` of ``k``. There is one code
path: SecAgg is the special case of the complete graph (``k = n - 1``, ``neighbours = 0``).

Per round, each client ``u`` with neighbours ``N(u)`` sends (all arithmetic mod ``R = 2^bits``)

    y_u = x_u + PRG(b_u) + sum_{v in N(u) cap U2, u < v} PRG(s_uv)
                         - sum_{v in N(u) cap U2, u > v} PRG(s_uv)                  (Round 2)

where ``x_u`` is the fixed-point encoded update, ``b_u`` a fresh self-mask seed, ``s_uv`` the
X25519 agreement of ``u``'s and ``v``'s mask keys and ``U2`` the clients whose key shares were
routed. The pairwise masks cancel in the sum; the server removes the rest (Round 4):

    z = sum_{u in U3} y_u - sum_{u in U3} PRG(b_u)
        + sum_{u in U2 - U3} sum_{v in N(u) cap U3} (+/-) PRG(s_uv)

with ``b_u`` rebuilt from ``t`` Shamir shares for every client whose masked input arrived
(``U3``) and the mask private key ``s_u^SK`` rebuilt for every client that shared its keys but
dropped before sending its masked input. No client ever reveals both shares of one client.

Primitives (all from ``cryptography``): X25519 key agreement and HKDF-SHA256 (context binding
the round id and both client ids in canonical order) give 32-byte keys; key advertisements are
signed with each client's long-term Ed25519 identity key and verified against the enrolled
registry; shares travel encrypted with AES-256-GCM (associated data binding sender, receiver
and round; the server only relays ciphertexts); masks are AES-256-CTR keystreams read as
little-endian 64-bit words. Shamir sharing is over the prime field ``GF(2^521 - 1)`` with
randomness from :mod:`secrets`.

Round 3 (*ConsistencyCheck*, :mod:`~privacy.secagg.consistency`) holds against a server that
deviates from the protocol: each survivor signs the survivor set ``U3`` (with the round id and
the advertisement set it saw) and reveals nothing until more than ``(n + c) / 2`` of the cohort
signed the same one, so every client that reveals acts on one ``U3`` and no client's two
secrets can both be rebuilt from honest shares (docs/secure-aggregation.md).

The protocol, one module per concept: :mod:`~privacy.secagg.messages` (the wire messages, in
the strict binary format of :mod:`~privacy.secagg.codec`), :mod:`~privacy.secagg.shamir`,
:mod:`~privacy.secagg.encoding` (fixed point), :mod:`~privacy.secagg.masks`,
:mod:`~privacy.secagg.keys`, :mod:`~privacy.secagg.graph`, :mod:`~privacy.secagg.config`, and
the two parties, :mod:`~privacy.secagg.client` and :mod:`~privacy.secagg.server`. A round over
the wire (the task's :mod:`~privacy.secagg.round_setup`, its :mod:`~privacy.secagg.stages`)
is run by :mod:`~privacy.secagg.server_round` and :mod:`~privacy.secagg.client_round`; a
simulation runs a whole cohort's round in one process with them
(:mod:`~privacy.secagg.in_process`), or, for cohorts too large to mask, sums in the clear and
says so (:mod:`~privacy.secagg.cost_only`).

Errors: :class:`~fl_secure.errors.ProtocolError` for malformed or out-of-order messages,
:class:`~fl_secure.errors.PrivacyError` for authentication failures (bad signature, tampered
ciphertext) and refused reveals, :class:`~fl_secure.errors.RoundAborted` when too few clients
remain for the thresholds (the sum is then never computed).
"""
