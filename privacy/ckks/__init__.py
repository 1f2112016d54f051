"""Homomorphic aggregation of model updates with CKKS (TenSEAL).

Each client packs its (optionally weighted) update into CKKS ciphertexts and signs them; the
server checks and keeps the signed uploads; one or two clients chosen by the server sum them
themselves after checking every signature, decrypt the sum and flood it with noise.
Transport-free: everything here is ``bytes`` in, ``bytes`` out.

One module per concept: the keys and contexts (:mod:`~privacy.ckks.context`, their files
:mod:`~privacy.ckks.keys`), the packing (:mod:`~privacy.ckks.layout`), the encrypted update
(:mod:`~privacy.ckks.update`), encryption and decryption (:mod:`~privacy.ckks.encryption`),
the running sum (:mod:`~privacy.ckks.aggregator`), the signed upload
(:mod:`~privacy.ckks.signed`), the decryptor's checked sum (:mod:`~privacy.ckks.verified_sum`)
and its noise (:mod:`~privacy.ckks.flooding`), and a round over the wire
(:mod:`~privacy.ckks.round_setup`, :mod:`~privacy.ckks.server_round`,
:mod:`~privacy.ckks.client_round`).
"""
