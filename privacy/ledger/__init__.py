"""Privacy ledgers: the run's, kept by the server, and each site's own.

The run ledger (:mod:`~privacy.ledger.run_ledger`) is an append-only, hash-chained record of
every privacy release of a run: its rows (:mod:`~privacy.ledger.entries`), their verification
(:mod:`~privacy.ledger.verification`), the guarantee they state
(:mod:`~privacy.ledger.guarantee`) and their readable and JSON forms
(:mod:`~privacy.ledger.formatting`). The site ledger (:mod:`~privacy.ledger.site_ledger`) is a
site's own record of the updates it released, and its epsilon against the server.
"""
