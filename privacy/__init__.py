"""Privacy of fl-secure: differential privacy, secure aggregation, CKKS and the ledgers.

Sub-packages: :mod:`privacy.dp` (noise, accountants, calibration, client-level DP, DP-SGD),
:mod:`privacy.secagg` (SecAgg/SecAgg+), :mod:`privacy.ckks` (homomorphic aggregation) and
:mod:`privacy.ledger` (the run's and each site's ledger). A run's privacy, round by round, is
:mod:`privacy.server_round` on the server and :mod:`privacy.client_round` on a client.
"""
