"""Homomorphic aggregation of model updates with CKKS (TenSEAL): the server sums ciphertexts.

Each client packs its (optionally weighted) update into CKKS ciphertexts; the server adds the
ciphertexts as they arrive, holding only a running encrypted sum, and hands the encrypted sum
back; the clients decrypt it. Transport-free: everything here is ``bytes`` in, ``bytes`` out.

One module per concept: the keys and contexts (:mod:`~privacy.ckks.context`, their files
:mod:`~privacy.ckks.keys`), the packing (:mod:`~privacy.ckks.layout`), the encrypted update
(:mod:`~privacy.ckks.update`), encryption and decryption (:mod:`~privacy.ckks.encryption`),
the server's sum (:mod:`~privacy.ckks.aggregator`), and a round over the wire
(:mod:`~privacy.ckks.round_setup`, :mod:`~privacy.ckks.server_round`,
:mod:`~privacy.ckks.client_round`).
"""
